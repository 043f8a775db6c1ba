"""MORI's disk tier (``mori.vllm_plugin.disk_tier``) against vLLM's secondary-tier interface:
chunk files evicted in MORI's label order, torn files as misses, a disk that fills at run
time, the start-up refusals and stale directories; and the CPU build's tiering spec
(``host_tier.MoriTieringOffloadingSpec``) with the disk tier behind the host tier."""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import pathlib
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob

from mori.vllm_plugin import connector_config, disk_tier
from mori.vllm_plugin.disk_tier import (
    HEADER,
    LOCK_NAME,
    MAGIC,
    DiskTierError,
    MoriDiskTier,
    decode_chunk,
    encode_chunk,
    hold_directory,
    live_tiers,
    remove_stale,
)
from mori.vllm_plugin.host_tier import HostCopyOffloadingWorker, MoriTieringOffloadingSpec

from .conftest import ENGINE_BLOCK, ENGINE_BLOCKS, engine_configs, engine_side, tiny_model_dir

CHUNK = 4096  # bytes of one chunk of the test's primary tier
FILE = CHUNK + HEADER.size  # bytes of its file
SLOTS = 16  # chunks of the primary tier
_req_ids = itertools.count()


def key(name: str, group: int = 0) -> OffloadKey:
    return make_offload_key(name.encode().ljust(32, b"\0"), group)


def ctx(program: str | None) -> ReqContext:
    params = {connector_config.PROGRAM_KEY: program} if program is not None else None
    return ReqContext(req_id=f"r{next(_req_ids)}", kv_transfer_params=params)


def labelled(labels: dict[str, str]) -> Callable[[str], str]:
    return lambda program: labels.get(program, "busy")


def engine(name: str) -> Any:
    """A stand-in for the offloading spec: the tier reads only ``config.engine_id``."""
    return SimpleNamespace(config=SimpleNamespace(engine_id=name))


@dataclass
class Rig:
    """A disk tier over a primary tier of ``SLOTS`` random chunks, driven as vLLM's tiering
    manager drives it (submit, then collect the finished jobs)."""

    tier: MoriDiskTier
    primary: np.ndarray  # (SLOTS, CHUNK) int8: what the tier's primary view shows
    _jobs: Iterator[int] = field(default_factory=itertools.count)

    def submit(self, program: str | None, names: list[str], cids: Iterable[int],
               promotion: bool) -> int:
        job = next(self._jobs)
        transfer = TransferJob(job, [key(n) for n in names],
                               np.array(list(cids), dtype=np.int64), promotion, ctx(program))
        if promotion:
            self.tier.submit_load(transfer)
        else:
            self.tier.submit_store(transfer)
        return job

    def finish(self) -> dict[int, JobResult]:
        self.tier.drain_jobs()
        return {r.job_id: r for r in self.tier.get_finished_jobs()}

    def store(self, program: str | None, names: list[str],
              cids: Iterable[int] | None = None) -> JobResult:
        job = self.submit(program, names, range(len(names)) if cids is None else cids, False)
        return self.finish()[job]

    def load(self, program: str | None, names: list[str], cids: Iterable[int]) -> JobResult:
        job = self.submit(program, names, cids, True)
        return self.finish()[job]

    def hits(self, names: Iterable[str]) -> list[bool]:
        return [self.tier.lookup(key(n), ctx(None)) == LookupResult.HIT for n in names]

    def on_disk(self, names: Iterable[str]) -> list[bool]:
        return [self.tier.path_of(key(n)).exists() for n in names]

    def files(self) -> set[str]:
        """The names of the tier's chunk files (``<key hex>.kv``)."""
        return {p.name for p in self.tier.root.iterdir() if p.suffix == ".kv"}

    def files_of(self, names: Iterable[str]) -> set[str]:
        return {self.tier.path_of(key(n)).name for n in names}


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Callable[[int], Rig]]:
    """``rig(chunks)``: a fresh tier of ``chunks`` files under ``tmp_path / "disk"``; shut
    down at the end unless the test did."""
    made: list[MoriDiskTier] = []
    parent = tmp_path / "disk"
    parent.mkdir()

    def make(chunks: int) -> Rig:
        primary = np.random.default_rng(len(made)).integers(
            -128, 128, (SLOTS, CHUNK), dtype=np.int8)
        tier = MoriDiskTier(engine(f"t{len(made)}"), memoryview(primary), "MoriDiskTier",
                            path=str(parent), capacity_bytes=chunks * FILE)
        made.append(tier)
        assert tier.max_chunks == chunks and tier.chunk_bytes == CHUNK
        return Rig(tier, primary)

    yield make
    for tier in made:
        if tier.root.exists():
            tier.shutdown()


# -- eviction order ------------------------------------------------------------------------
def test_evicts_inactive_then_busy_then_idle_then_cold_lru_within(
        rig: Callable[[int], Rig]) -> None:
    """A full tier of 8 files, four labelled programs of 2 chunks each, the cold one the
    oldest and the inactive one the newest: stores evict by class first, then LRU."""
    r = rig(8)
    t = r.tier
    t.bind(labelled({"C": "cold", "D": "idle", "B": "busy", "I": "inactive"}))
    for p in "CDBI":  # C oldest, I newest
        assert r.store(p, [f"{p.lower()}0", f"{p.lower()}1"]).success
    assert t.num_chunks == 8 and t.chunks_held() == {"C": 2, "D": 2, "B": 2, "I": 2}
    assert [t.class_of(key(n)) for n in ("c0", "d0", "b0", "i0")] == [
        "cold", "idle", "busy", "inactive"]

    assert r.store("X", ["x0", "x1"]).success  # X: no label, busy
    assert r.hits(["i0", "i1"]) == [False, False]  # inactive first, although the newest
    assert r.on_disk(["i0", "i1"]) == [False, False]
    assert t.chunks_held() == {"C": 2, "D": 2, "B": 2, "X": 2}
    assert t.evicted_by_class == {"inactive": 2, "busy": 0, "idle": 0, "cold": 0}

    r.store("Y", ["y0", "y1", "y2"])  # busy, LRU: B's two, then X's older chunk
    assert r.hits(["b0", "b1", "x0", "x1"]) == [False, False, False, True]
    assert t.evicted_by_class == {"inactive": 2, "busy": 3, "idle": 0, "cold": 0}

    r.store("Z", [f"z{i}" for i in range(6)])  # the 4 busy ones, then idle D
    assert r.hits(["x1", "y0", "y1", "y2", "d0", "d1"]) == [False] * 6
    assert r.hits(["c0", "c1"]) == [True, True]  # the full tier kept the cold program's
    assert t.evicted_by_class == {"inactive": 2, "busy": 7, "idle": 2, "cold": 0}
    assert t.chunks_held() == {"C": 2, "Z": 6}

    r.store("W", [f"w{i}" for i in range(7)])  # Z's 6, then cold at last: C's older chunk
    assert r.hits(["c0", "c1"]) == [False, True]
    assert t.evicted_by_class == {"inactive": 2, "busy": 13, "idle": 2, "cold": 1}
    held = ["c1"] + [f"w{i}" for i in range(7)]
    assert t.num_chunks == 8 and r.files() == r.files_of(held)  # the evicted files deleted
    assert t.stats["dropped_chunks"] == 0


def test_unbound_tier_evicts_least_recently_used_first(rig: Callable[[int], Rig]) -> None:
    """Without ``bind`` every chunk is busy whatever its program: plain LRU, where a touch
    and a load are uses."""
    r = rig(4)
    t = r.tier
    assert not t.bound
    r.store("A", ["a0", "a1"])
    r.store("B", ["b0", "b1"])
    assert {t.class_of(key(n)) for n in ("a0", "a1", "b0", "b1")} == {"busy"}
    t.touch([key("a0"), key("never")], ctx("A"))  # an unknown key is ignored
    r.store("C", ["c0", "c1"])
    assert r.hits(["a0", "a1", "b0", "b1", "c0", "c1"]) == [
        True, False, False, True, True, True]
    assert r.load("B", ["b1"], [9]).success  # b1 is now the most recent
    r.store("D", ["d0"])
    assert r.hits(["a0", "c0", "c1", "b1", "d0"]) == [False, True, True, True, True]
    assert t.evicted_by_class == {"inactive": 0, "busy": 3, "idle": 0, "cold": 0}
    assert r.files() == r.files_of(["c0", "c1", "b1", "d0"])


def test_a_dropped_programs_own_chunks_go_first(rig: Callable[[int], Rig]) -> None:
    r = rig(5)
    t = r.tier
    labels = {"A": "idle", "B": "idle", "C": "busy"}
    t.bind(labelled(labels))
    r.store("C", ["c0", "c1"])  # the oldest
    r.store("A", ["p0", "a1"])
    r.store("B", ["p0", "b1"])  # p0 shared with A
    assert t.chunks_held() == {"A": 2, "B": 2, "C": 2}
    del labels["A"]  # the gateway dropped A ...
    assert t.drop("A") == 1  # ... a1, A's alone, is inactive
    assert t.drop("A") == 0
    assert t.class_of(key("a1")) == "inactive"
    assert t.class_of(key("p0")) == "idle"  # still B's
    assert t.chunks_held() == {"B": 2, "C": 2}
    r.store(None, ["x0"])
    assert r.hits(["a1", "c0"]) == [False, True]  # a1 before C's older busy chunks
    r.store(None, ["x1"])
    assert r.hits(["c0", "p0"]) == [False, True]  # then busy, before the shared idle one
    assert t.evicted_by_class == {"inactive": 1, "busy": 1, "idle": 0, "cold": 0}
    assert t.drop("B") == 2  # p0 and b1: nobody's now
    assert t.class_of(key("p0")) == t.class_of(key("b1")) == "inactive"


# -- loads, torn files ------------------------------------------------------------------------
def test_a_load_round_trips_and_a_torn_file_is_a_miss(rig: Callable[[int], Rig]) -> None:
    r = rig(8)
    t = r.tier
    names = ["g0", "t1", "t2", "t3", "m4"]
    stored = r.store("P", names, range(5))
    assert stored.success and stored.transfer_bytes == 5 * FILE
    orig = r.primary[:5].copy()
    good = r.load("P", ["g0"], [8])
    assert good.success and good.successful_keys is None and good.transfer_bytes == FILE
    assert np.array_equal(r.primary[8], orig[0])

    p1, p2, p3 = (t.path_of(key(n)) for n in ("t1", "t2", "t3"))
    p1.write_bytes(p1.read_bytes()[:-10])  # truncated
    flipped = bytearray(p2.read_bytes())
    flipped[HEADER.size + 100] ^= 0xFF  # one payload byte
    p2.write_bytes(bytes(flipped))
    p3.write_bytes(encode_chunk(bytes(key("other")), orig[3].tobytes()))  # another key's
    t.path_of(key("m4")).unlink()  # gone: a miss, not torn
    r.primary[9:13] = 7
    res = r.load("P", ["t1", "t2", "g0", "t3", "m4"], [9, 10, 13, 11, 12])
    assert res.success is False
    assert list(res.successful_keys or []) == [key("g0")]
    assert res.transfer_bytes == FILE
    assert np.array_equal(r.primary[13], orig[0])
    assert (r.primary[9:13] == 7).all()  # the torn and missing chunks' slots untouched
    assert r.on_disk(names) == [True, False, False, False, False]
    assert r.hits(names) == [True, False, False, False, False]
    assert t.stats["torn_chunks"] == 3 and t.stats["loaded_chunks"] == 2
    assert t.num_chunks == 1 and t.chunks_held() == {"P": 1}
    r.store("X", [f"x{i}" for i in range(8)])  # g0 is no longer being read: evictable
    assert r.hits(["g0"]) == [False] and t.stats["dropped_chunks"] == 0


# -- a tier that fills at run time ------------------------------------------------------------
def blocked(tier: MoriDiskTier) -> threading.Event:
    """Hold the tier's I/O thread until the returned event is set."""
    gate = threading.Event()
    tier._pool.submit(gate.wait, 30)
    return gate


def test_a_store_that_does_not_fit_beside_chunks_being_read_is_dropped(
        rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    t = r.tier
    r.store("A", ["a0", "a1"])
    gate = blocked(t)
    try:
        load = r.submit("A", ["a0", "a1"], [5, 6], True)  # not collected yet: being read
        store = r.submit("X", ["x0"], [2], False)
        assert t.stats["dropped_chunks"] == 1
        assert r.hits(["x0"]) == [False]
    finally:
        gate.set()
    done = r.finish()
    assert done[load].success and done[store].transfer_bytes == 0
    assert np.array_equal(r.primary[5:7], r.primary[0:2])
    assert r.hits(["a0", "a1", "x0"]) == [True, True, False]
    assert t.num_chunks == 2 and r.files() == r.files_of(["a0", "a1"])
    assert t.evicted_by_class == {"inactive": 0, "busy": 0, "idle": 0, "cold": 0}
    r.store("X", ["x0"], [2])  # read done: now it evicts (LRU: a0)
    assert r.hits(["a0", "a1", "x0"]) == [False, True, True]


def test_chunks_being_written_are_not_evicted(rig: Callable[[int], Rig]) -> None:
    r = rig(2)
    t = r.tier
    gate = blocked(t)
    try:
        for name in ("a0", "a1", "b0"):
            r.submit("A", [name], [0], False)
        assert t.stats["dropped_chunks"] == 1  # b0: a0 and a1 are not written yet
    finally:
        gate.set()
    assert all(res.success for res in r.finish().values())
    assert r.hits(["a0", "a1", "b0"]) == [True, True, False]
    assert r.files() == r.files_of(["a0", "a1"])


def failing_open(code: int) -> Callable[..., Any]:
    """``open`` for the tier's module: a write starts a partial file, then fails with
    ``code``."""
    real = open

    def fake(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real(file, mode, *args, **kwargs)
        if "w" in mode:
            f.write(b"\0" * 100)
            f.close()
            raise OSError(code, os.strerror(code), str(file))
        return f

    return fake


def test_a_full_disk_shrinks_the_tier_to_what_it_holds(
        rig: Callable[[int], Rig], monkeypatch: pytest.MonkeyPatch) -> None:
    r = rig(4)
    t = r.tier
    t.bind(labelled({"A": "inactive", "C": "cold"}))
    r.store("C", ["c0"])
    r.store("A", ["a0", "a1"])
    with monkeypatch.context() as m:
        m.setattr(disk_tier, "open", failing_open(errno.EIO), raising=False)
        res = r.store(None, ["e0"])
        assert res.success is False and t.max_chunks == 4  # another error: no shrink
        m.setattr(disk_tier, "open", failing_open(errno.ENOSPC), raising=False)
        res = r.store(None, ["x0"])
    assert res.success is False and res.transfer_bytes == 0
    assert t.max_chunks == 3 and t.num_chunks == 3
    assert r.hits(["x0", "e0"]) == [False, False]
    assert {p.name for p in t.root.iterdir()} == r.files_of(["c0", "a0", "a1"]) | {LOCK_NAME}
    res = r.store(None, ["y0"])  # no longer fails: evicts, in MORI's order
    assert res.success and r.hits(["y0", "a0"]) == [True, False]
    r.store(None, ["z0", "z1"])  # a1 (inactive), then y0 (busy): cold c0 stays
    assert r.hits(["a1", "y0", "c0", "z0", "z1"]) == [False, False, True, True, True]
    assert t.evicted_by_class == {"inactive": 2, "busy": 1, "idle": 0, "cold": 0}
    assert t.max_chunks == 3 and t.num_chunks == 3 and t.stats["dropped_chunks"] == 0
    assert r.files() == r.files_of(["c0", "z0", "z1"])


# -- start-up -----------------------------------------------------------------------------------
def start(path: Path, capacity: int = 4 * FILE, **settings: Any) -> MoriDiskTier:
    view = memoryview(np.zeros((2, CHUNK), dtype=np.int8))
    return MoriDiskTier(engine("s"), view, "MoriDiskTier", path=str(path),
                        capacity_bytes=capacity, **settings)


def test_start_refuses_a_missing_directory_or_a_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(DiskTierError, match="does not exist") as e:
        start(missing)
    assert str(missing) in str(e.value) and f"mkdir -p {missing}" in str(e.value)
    assert "--disk-dir" in str(e.value) and not missing.exists()
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(DiskTierError, match="is not a directory") as e:
        start(a_file)
    assert str(a_file) in str(e.value) and "--disk-dir" in str(e.value)


def test_start_refuses_a_directory_it_cannot_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path, data: bytes) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "write_bytes", refuse)
    with pytest.raises(DiskTierError, match="is not writable") as e:
        start(tmp_path)
    assert str(tmp_path) in str(e.value) and "Permission denied" in str(e.value)
    assert "give a writable one (--disk-dir)" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_start_refuses_too_little_free_space(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    capacity = 4 * FILE
    free = capacity - 1

    def usage(path: Any) -> Any:
        return SimpleNamespace(total=10 * capacity, used=10 * capacity - free, free=free)

    monkeypatch.setattr(disk_tier.shutil, "disk_usage", usage)
    with pytest.raises(DiskTierError, match="GiB free") as e:
        start(tmp_path, capacity)
    assert str(tmp_path) in str(e.value) and "lower --disk-gib or free space" in str(e.value)
    assert list(tmp_path.iterdir()) == []
    free = capacity  # just enough
    tier = start(tmp_path, capacity)
    try:
        assert tier.max_chunks == 4
    finally:
        tier.shutdown()


def test_start_refuses_a_capacity_below_one_chunk(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match="capacity_bytes must be > 0"):
        start(tmp_path, 0)
    with pytest.raises(DiskTierError, match="hold no chunk") as e:
        start(tmp_path, FILE - 1)
    assert f"{FILE - 1} bytes hold no chunk of {FILE} bytes" in str(e.value)
    assert "raise --disk-gib" in str(e.value)
    # a refused start leaves nothing behind: no directory, no lock held
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    tier = start(tmp_path, FILE)  # the same engine, now with room for one chunk
    try:
        assert tier.max_chunks == 1
    finally:
        tier.shutdown()


def test_start_refuses_unknown_settings(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match=r"unknown settings \['size'\]") as e:
        start(tmp_path, size=3)
    assert "path and capacity_bytes" in str(e.value)
    assert list(tmp_path.iterdir()) == []


# -- stale directories --------------------------------------------------------------------------
def test_a_starting_tier_removes_the_directories_no_engine_holds(tmp_path: Path) -> None:
    dead = tmp_path / "mori-kv-dead"  # a killed engine's: its lock is free
    dead.mkdir()
    (dead / LOCK_NAME).touch()
    (dead / "00.kv").write_bytes(b"x")
    live = tmp_path / "mori-kv-live"  # a running engine's
    live_fd = hold_directory(live)
    (live / "01.kv").write_bytes(b"x")
    other = tmp_path / "mori-kv-other"  # not a tier's directory (no lock): left alone
    other.mkdir()
    (other / "keep").write_bytes(b"x")
    a_file = tmp_path / "mori-kv-file"
    a_file.write_bytes(b"x")
    try:
        # flock is per open file description: another open of the lock in this process
        # conflicts, as another engine's would
        fd = os.open(live / LOCK_NAME, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        with pytest.raises(DiskTierError, match="held by another engine"):
            hold_directory(live)
        tier = start(tmp_path)
        assert tier.root == tmp_path / "mori-kv-s" and (tier.root / LOCK_NAME).exists()
        assert not dead.exists()
        assert (live / "01.kv").exists() and (other / "keep").exists() and a_file.exists()
        assert remove_stale(tmp_path, keep=tier.root) == 0  # its own directory is held
        tier.shutdown()
        assert not tier.root.exists()
        assert remove_stale(tmp_path, keep=tier.root) == 0
    finally:
        os.close(live_fd)
    assert remove_stale(tmp_path, keep=tmp_path / "mori-kv-s") == 1  # live's engine ended
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mori-kv-file", "mori-kv-other"]


# -- the chunk file format ----------------------------------------------------------------------
def test_chunk_files_round_trip_and_torn_ones_decode_to_none() -> None:
    payload = np.random.default_rng(1).integers(0, 256, 100, dtype=np.uint8).tobytes()
    k = bytes(key("k"))
    data = encode_chunk(k, memoryview(payload))
    assert len(data) == HEADER.size + 100 and data.startswith(MAGIC)
    assert decode_chunk(k, data, 100) == payload
    assert decode_chunk(k, data[:-1], 100) is None  # short
    assert decode_chunk(k, data + b"\0", 100) is None  # long
    assert decode_chunk(k, data, 99) is None  # not the tier's chunk size
    assert decode_chunk(k, b"XORIKV01" + data[len(MAGIC):], 100) is None  # magic
    flipped = bytearray(data)
    flipped[-1] ^= 1
    assert decode_chunk(k, bytes(flipped), 100) is None  # checksum
    assert decode_chunk(bytes(key("j")), data, 100) is None  # another chunk's
    assert decode_chunk(bytes(key("k", 1)), data, 100) is None  # another group's
    _, _, crc, stored = HEADER.unpack_from(data)
    lying = HEADER.pack(MAGIC, 99, crc, stored) + payload  # length field disagrees
    assert decode_chunk(k, lying, 100) is None


# -- the copy worker over strided host rows -----------------------------------------------------
def test_copy_worker_over_strided_host_rows() -> None:
    """``host_view``: each tensor's host chunks are a strided view of one buffer (a row per
    chunk holding every tensor, with padding), as the tiering spec's shared region gives."""
    page, bpc, n = 64, 2, 4
    row = 2 * page * bpc + 64  # both tensors' chunk bytes and 64 bytes of padding
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randint(-128, 128, (10, page), dtype=torch.int8, generator=gen)
          for _ in range(2)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in ts],
                           [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])
    base = torch.full((n * row,), 7, dtype=torch.int8)
    offsets = iter([0, page * bpc])

    def view(nbytes: int) -> torch.Tensor:
        return torch.as_strided(base, (n, nbytes), (row, 1), next(offsets))

    w = HostCopyOffloadingWorker(kv, blocks_per_chunk=bpc, num_chunks=n, host_view=view)
    assert w.submit_store(1, engine_side(GPULoadStoreSpec([1, 2, 3, 4], [4], [0]), kv),
                          CPULoadStoreSpec([3, 0]))
    rows = base.view(n, row)
    for c, blocks in ((3, [1, 2]), (0, [3, 4])):
        for i, t in enumerate(ts):
            at = i * page * bpc
            assert torch.equal(rows[c, at:at + page * bpc], torch.cat([t[b] for b in blocks]))
        assert (rows[c, 2 * page * bpc:] == 7).all()  # the padding untouched
    assert (rows[[1, 2]] == 7).all()
    orig = [t[1:5].clone() for t in ts]
    assert w.submit_load(2, CPULoadStoreSpec([3, 0]),
                         engine_side(GPULoadStoreSpec([5, 6, 7, 8], [4], [0]), kv))
    for t, o in zip(ts, orig, strict=True):
        assert torch.equal(t[5:9], o)
    assert [r.transfer_size for r in w.get_finished()] == [4 * 2 * page] * 2

    def column_strided(nbytes: int) -> torch.Tensor:
        return torch.as_strided(base, (n, nbytes), (row, 2), 0)

    with pytest.raises(ValueError, match="unit column stride"):
        HostCopyOffloadingWorker(kv, blocks_per_chunk=1, num_chunks=n,
                                 host_view=column_strided)


# -- the tiering spec, built by vLLM's own factory ----------------------------------------------
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PAGE = 2 * ENGINE_BLOCK * 1 * 64 * 4  # K and V, 1 KV head of 64 floats: bytes per block


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


def test_tiering_spec_puts_the_disk_tier_behind_the_host_tier(
        model_dir: Path, tmp_path: Path) -> None:
    """``kv_transfer_config(disk_bytes=, disk_dir=)`` on the CPU build: vLLM builds
    ``MoriTieringOffloadingSpec``, whose manager has the disk tier over the shared region;
    KV blocks go engine -> host chunk (copy worker) -> file (disk tier), and back into
    other chunks and blocks."""
    disk_bytes = 10 * (2 * PAGE + HEADER.size) + 5
    cfg = connector_config.kv_transfer_config(1 << 20, disk_bytes=disk_bytes,
                                              disk_dir=str(tmp_path))
    vc, kvc = engine_configs(model_dir, LAYERS, cfg)
    spec = OffloadingSpecFactory.create_spec(build_offloading_config(vc, kvc))
    assert isinstance(spec, MoriTieringOffloadingSpec)
    assert spec.kv_bytes_per_chunk == 2 * PAGE
    mgr = spec.get_manager()
    try:
        (tier,) = [t for t in live_tiers() if t.root.parent == tmp_path]
        assert tier.root.name == f"mori-kv-{vc.kv_transfer_config.engine_id}"
        assert tier.chunk_bytes == 2 * PAGE and tier.max_chunks == 10
        conn = OffloadingConnector(vc, KVConnectorRole.WORKER, kvc)
        kv = {n: torch.randn(ENGINE_BLOCKS, 1, ENGINE_BLOCK, 2 * 64) for n in LAYERS}
        conn.register_kv_caches(kv)
        w = conn.connector_worker.worker
        try:
            assert isinstance(w, HostCopyOffloadingWorker)
            assert [h.stride() for h in w.host] == [(2 * PAGE, 1)] * len(LAYERS)
            orig = {n: t[[2, 3]].clone() for n, t in kv.items()}
            registered = getattr(conn.connector_worker, "_kv_caches", None)  # 0.34
            assert w.submit_store(1, engine_side(GPULoadStoreSpec([2, 3], [2], [0]),
                                                 registered), CPULoadStoreSpec([5, 1]))
            ks = [key("k5"), key("k1")]
            tier.submit_store(TransferJob(1, ks, np.array([5, 1]), False, ctx("A")))
            tier.drain_jobs()
            assert [r.success for r in tier.get_finished_jobs()] == [True]
            for h in w.host:
                h.zero_()
            tier.submit_load(TransferJob(2, ks, np.array([0, 7]), True, ctx("A")))
            tier.drain_jobs()
            assert [r.success for r in tier.get_finished_jobs()] == [True]
            for t in kv.values():
                t.zero_()
            assert w.submit_load(2, CPULoadStoreSpec([0, 7]),
                                 engine_side(GPULoadStoreSpec([7, 8], [2], [0]), registered))
            for n, t in kv.items():
                assert torch.equal(t[[7, 8]], orig[n])
                assert not t[[2, 3]].any()
        finally:
            region = conn.connector_worker.spec._worker_region
            if region is not None:
                region.cleanup()
    finally:
        mgr.shutdown()
    assert not tier.root.exists()
