"""MORI's disk tier for vLLM: host chunks kept as files on a local disk, evicted in MORI's
order.

vLLM's ``TieringOffloadingSpec`` (``v1/kv_offload/tiering/``, 0.32 to 0.34) puts secondary
tiers behind its CPU tier: every chunk stored to the CPU tier is *cascaded* to each
secondary tier (written through), and a chunk the CPU tier no longer holds is *promoted*
back from a secondary tier into a CPU slot, then loaded to the GPU as a host hit. A
secondary tier runs in the scheduler's process and reads and writes the CPU tier's chunks
through ``primary_kv_view`` (the tier's shared memory); an out-of-tree tier is named by
``type`` + ``module_path`` in ``secondary_tiers`` (``tiering/factory.py``).

:class:`MoriDiskTier` is such a tier:

- **Files.** Each chunk is one file, ``<dir>/mori-kv-<engine>/<key hex>.kv``: a header
  (magic, payload length, CRC-32 of the payload, the chunk's key) and the chunk's bytes.
  A file is written under a temporary name and renamed into place, so a crash leaves no
  half file under a chunk's name; a file that is short, or whose checksum or key does not
  match, is a **miss**: it is deleted, never served, and the request recomputes those
  tokens. The directory is the engine's own (its engine id), locked (``flock``) while the
  engine lives, removed at shutdown; a tier starting in ``<dir>`` removes the
  ``mori-kv-*`` directories no live engine holds (those of an engine that was killed).
- **Capacity and order.** ``capacity_bytes`` over the file size gives the tier's chunks. A
  store that does not fit evicts ready chunks (none being read or written) in MORI's
  order: ``inactive`` first, then ``busy`` (its KV is on the GPU), then ``idle`` (on the
  CPU tier too), then ``cold`` (MORI parked the program here: the disk holds its only
  copy; ``mori.core.eviction_order``), least recently used first within a class. A chunk's class is the most protective
  label of the programs that stored or touched it (``kv_transfer_params["mori_program"]``,
  as the CPU tier's policy reads it); a chunk no known program used is ``busy``, so an
  unbound tier evicts by LRU. A chunk whose programs were all dropped is ``inactive``.
- **Filling at run time.** A chunk that does not fit (every ready chunk is more
  protected, or being read) is not written: the tier degrades to dropping, in MORI's
  order. A write that fails for want of space (``ENOSPC``) shrinks the tier to what it
  holds, so that later stores evict in MORI's order instead of failing.
- **I/O** runs on one background thread (the tier's methods must not block the
  scheduler): stores, then loads, in the order submitted; ``get_finished_jobs`` hands back
  the results. Eviction picks its victims by a pass over the tier's ready chunks (not a
  heap: fine for thousands of chunks, not measured beyond).

Start-up refuses, in one line naming the directory and what to do: a directory that does
not exist, is not a directory, is not writable, or has less free space than
``capacity_bytes``.

The MORI scheduler binds each tier built in its process (:func:`live_tiers`) to its label
table, as it binds the CPU tier's cache policy, and reports the tiers' size in the
handshake (``disk_tier_tokens``). ``connector_config.kv_transfer_config(disk_bytes=...,
disk_dir=...)`` (``mori vllm-args --disk-gib N --disk-dir PATH``) builds the flag.

This module imports vLLM; it is imported inside vLLM's processes only.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from mori.core.eviction_order import eviction_order, label_ranks, most_protected
from mori.core.types import Tier
from mori.plugin_channel.labels import DEFAULT_LABEL, MAX_PROGRAMS_PER_BLOCK

from .cpu_tier import TierLabels, program_of

logger = logging.getLogger("vllm.mori_plugin.disk_tier")

# Protection of a disk chunk by label (higher is evicted later): the disk tier's order of
# mori.core.eviction_order
DISK_PROTECTION = label_ranks(Tier.DISK)
EVICT_ORDER = tuple(label.value for label in eviction_order(Tier.DISK))  # first .. last
# a chunk used by more than MAX_PROGRAMS_PER_BLOCK programs: the most protected class
WIDE_CLASS = most_protected(Tier.DISK).value
MAGIC = b"MORIKV01"
HEADER = struct.Struct("<8sQI36s")  # magic, payload bytes, CRC-32, key (zero padded)
SUFFIX = ".kv"
DIR_PREFIX = "mori-kv-"
LOCK_NAME = ".lock"

_TIERS: weakref.WeakSet[MoriDiskTier] = weakref.WeakSet()


def live_tiers() -> list[MoriDiskTier]:
    """The :class:`MoriDiskTier` instances alive in this process."""
    return list(_TIERS)


class DiskTierError(ValueError):
    """A disk tier that cannot start (the text says why and what to do)."""


def check_directory(path: str | os.PathLike[str], capacity_bytes: int) -> Path:
    """The tier's parent directory, checked: it exists, is a writable directory, and has
    ``capacity_bytes`` free. Raises :class:`DiskTierError` otherwise."""
    if capacity_bytes <= 0:
        raise DiskTierError(f"MORI disk tier: capacity_bytes must be > 0, got "
                            f"{capacity_bytes} (mori vllm-args --disk-gib N)")
    where = Path(path)
    if not where.exists():
        raise DiskTierError(f"MORI disk tier: directory {where} does not exist: create it "
                            f"(mkdir -p {where}) or give another (--disk-dir)")
    if not where.is_dir():
        raise DiskTierError(f"MORI disk tier: {where} is not a directory (--disk-dir)")
    probe = where / f".mori-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise DiskTierError(f"MORI disk tier: directory {where} is not writable "
                            f"({e.strerror}): give a writable one (--disk-dir)") from None
    free = shutil.disk_usage(where).free
    if free < capacity_bytes:
        raise DiskTierError(
            f"MORI disk tier: {where} has {free / (1 << 30):.2f} GiB free and the tier "
            f"needs {capacity_bytes / (1 << 30):.2f} GiB: lower --disk-gib or free space")
    return where


def hold_directory(root: Path) -> int:
    """Make ``root`` and hold its lock for this process's life; the lock's fd."""
    root.mkdir(exist_ok=True)
    fd = os.open(root / LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DiskTierError(f"MORI disk tier: {root} is held by another engine") from None
    return fd


def remove_stale(parent: Path, keep: Path) -> int:
    """Remove the tier directories under ``parent`` that no live process holds (their
    lock is free); returns how many."""
    removed = 0
    for d in parent.glob(DIR_PREFIX + "*"):
        if d == keep or not d.is_dir():
            continue
        try:
            fd = os.open(d / LOCK_NAME, os.O_RDWR)
        except OSError:
            continue  # not a tier's directory (or not ours to read): left alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live engine's
        finally:
            os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed


def encode_chunk(key: bytes, payload: bytes | memoryview) -> bytes:
    """A chunk file's bytes: header, then the payload."""
    return HEADER.pack(MAGIC, len(payload), zlib.crc32(payload), key) + bytes(payload)


def decode_chunk(key: bytes, data: bytes, size: int) -> bytes | None:
    """The payload of a chunk file, or ``None`` when the file is torn (short, long,
    another chunk's, or its checksum does not match)."""
    if len(data) != HEADER.size + size:
        return None
    magic, length, crc, stored = HEADER.unpack_from(data)
    payload = data[HEADER.size:]
    if magic != MAGIC or length != size or stored.rstrip(b"\0") != key.rstrip(b"\0") \
            or zlib.crc32(payload) != crc:
        return None
    return payload


@dataclass(slots=True)
class _Chunk:
    rank: int  # recency: higher is more recent
    owners: set[str] = field(default_factory=set)
    ready: bool = False  # written and renamed into place
    readers: int = 0  # loads in flight
    wide: bool = False
    dropped: bool = False


@dataclass(slots=True)
class _Done:
    """What the I/O thread reports for one job."""

    job_id: int
    store: bool
    ok: list[OffloadKey]
    failed: list[OffloadKey]
    torn: list[OffloadKey]
    no_space: bool
    seconds: float
    nbytes: int


class MoriDiskTier(SecondaryTierManager):  # type: ignore[misc]
    """A secondary tier of chunk files evicted in MORI's order (module doc).

    ``path``: the directory the tier's own directory is made in; ``capacity_bytes``: the
    files' total size at most (headers included).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 path: str = "", capacity_bytes: int = 0,
                 backpressure_detector: Any = None, **unknown: Any) -> None:
        if unknown:
            raise DiskTierError(f"MORI disk tier: unknown settings {sorted(unknown)}; it "
                                "takes path and capacity_bytes")
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                         tier_type=tier_type, backpressure_detector=backpressure_detector)
        parent = check_directory(path, int(capacity_bytes))
        engine = str(getattr(getattr(offloading_spec, "config", None), "engine_id", "") or
                     os.getpid())
        self.chunk_bytes = int(self.block_size_bytes)
        self.file_bytes = HEADER.size + self.chunk_bytes
        self.capacity_bytes = int(capacity_bytes)
        self.max_chunks = self.capacity_bytes // self.file_bytes
        if self.max_chunks < 1:
            raise DiskTierError(
                f"MORI disk tier: {self.capacity_bytes} bytes hold no chunk of "
                f"{self.file_bytes} bytes: raise --disk-gib")
        self.root = parent / f"{DIR_PREFIX}{engine}"
        self._lock_fd: int | None = hold_directory(self.root)
        removed = remove_stale(parent, keep=self.root)
        if removed:
            logger.info("MORI disk tier: removed %d directories of engines no longer "
                        "running in %s", removed, parent)
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 \
            else primary_kv_view
        self._chunks: dict[OffloadKey, _Chunk] = {}
        self._keys_of: dict[str, set[OffloadKey]] = {}
        self._next_rank = 0
        self._jobs: dict[int, Future[_Done]] = {}
        self._done: list[_Done] = []
        self._lock = threading.Lock()  # guards _done (appended by the I/O thread)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mori-disk")
        self.labels = TierLabels(DISK_PROTECTION, "disk tier")
        self.evicted_by_class: dict[str, int] = dict.fromkeys(EVICT_ORDER, 0)
        self.stats: dict[str, int] = dict.fromkeys(
            ("stored_chunks", "loaded_chunks", "torn_chunks", "dropped_chunks",
             "written_bytes", "read_bytes"), 0)
        self._warned_full = False
        _TIERS.add(self)
        logger.info("MORI disk tier: %s, %d chunks of %d bytes (%.3f GiB)", self.root,
                    self.max_chunks, self.chunk_bytes, self.capacity_bytes / (1 << 30))

    # -- binding (by the MORI scheduler) -------------------------------------------------
    def bind(self, label: Callable[[str], str]) -> None:
        """Read programs' labels from ``label(program)`` from now on (looked up when the
        tier evicts: nothing to re-file)."""
        self.labels.bind(label)

    @property
    def bound(self) -> bool:
        return self.labels.bound

    def drop(self, program: str) -> int:
        """The gateway dropped ``program``: its chunks lose it as an owner; those it alone
        owned become ``inactive``. Returns how many became ``inactive``."""
        orphaned = 0
        for key in self._keys_of.pop(program, set()):
            chunk = self._chunks.get(key)
            if chunk is None:
                continue
            chunk.owners.discard(program)
            if not chunk.owners and not chunk.wide:
                chunk.dropped = True
                orphaned += 1
        return orphaned

    # -- reading -------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return sum(1 for c in list(self._chunks.values()) if c.ready)

    def chunks_held(self) -> dict[str, int]:
        """program -> ready chunks of the tier it owns (safe from another thread)."""
        for _ in range(5):
            try:
                return {p: sum(1 for k in list(keys) if (c := self._chunks.get(k))
                               is not None and c.ready)
                        for p, keys in list(self._keys_of.items()) if keys}
            except RuntimeError:
                continue
        return {}

    def class_of(self, key: OffloadKey) -> str:
        chunk = self._chunks[key]
        if chunk.wide:
            return WIDE_CLASS if self.bound else DEFAULT_LABEL
        if not chunk.owners:
            return EVICT_ORDER[0] if chunk.dropped else DEFAULT_LABEL
        best = EVICT_ORDER[0]
        for program in chunk.owners:
            label = self._label_of(program)
            if DISK_PROTECTION[label] > DISK_PROTECTION[best]:
                best = label
        return best

    def _label_of(self, program: str) -> str:
        return self.labels(program)

    def path_of(self, key: OffloadKey) -> Path:
        return self.root / (bytes(key).hex() + SUFFIX)

    # -- bookkeeping -----------------------------------------------------------------------
    def _fresh_rank(self) -> int:
        self._next_rank += 1
        return self._next_rank

    def _own(self, key: OffloadKey, program: str | None) -> None:
        chunk = self._chunks.get(key)
        if chunk is None or program is None or chunk.wide or program in chunk.owners:
            return
        chunk.dropped = False
        if len(chunk.owners) >= MAX_PROGRAMS_PER_BLOCK:
            chunk.wide = True
            for p in chunk.owners:
                self._forget_owner(p, key)
            chunk.owners.clear()
            return
        chunk.owners.add(program)
        self._keys_of.setdefault(program, set()).add(key)

    def _forget_owner(self, program: str, key: OffloadKey) -> None:
        keys = self._keys_of.get(program)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._keys_of[program]

    def _remove(self, key: OffloadKey) -> None:
        chunk = self._chunks.pop(key, None)
        if chunk is None:
            return
        for p in chunk.owners:
            self._forget_owner(p, key)

    def _victims(self, n: int) -> list[OffloadKey]:
        """Up to ``n`` ready, unread chunks, in MORI's order."""
        if n <= 0:
            return []
        candidates = [(DISK_PROTECTION[self.class_of(k)], c.rank, k)
                      for k, c in self._chunks.items() if c.ready and c.readers == 0]
        candidates.sort()
        return [k for _, _, k in candidates[:n]]

    # -- SecondaryTierManager --------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        chunk = self._chunks.get(key)
        return LookupResult.HIT if chunk is not None and chunk.ready else LookupResult.MISS

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        program = program_of(req_context)
        for key in keys:
            chunk = self._chunks.get(key)
            if chunk is not None:
                chunk.rank = self._fresh_rank()
                self._own(key, program)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def submit_store(self, job_metadata: TransferJob) -> None:
        program = program_of(job_metadata.req_context)
        todo: list[tuple[OffloadKey, int]] = []
        for key, cid in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            if key in self._chunks:  # present or being written: a use
                self._chunks[key].rank = self._fresh_rank()
                self._own(key, program)
            else:
                todo.append((key, int(cid)))
        room = self.max_chunks - len(self._chunks)
        if len(todo) > room:
            victims = self._victims(len(todo) - room)
            for key in victims:
                self.evicted_by_class[self.class_of(key)] += 1
                self._remove(key)
            self._pool.submit(self._delete, [self.path_of(k) for k in victims])
            room += len(victims)
        if len(todo) > room:  # full of protected or busy chunks: drop the rest
            self.stats["dropped_chunks"] += len(todo) - max(room, 0)
            todo = todo[:max(room, 0)]
        for key, _ in todo:
            self._chunks[key] = _Chunk(rank=self._fresh_rank())
            self._own(key, program)
        job = job_metadata.job_id
        self._jobs[job] = self._pool.submit(self._write, job, todo)

    def submit_load(self, job_metadata: TransferJob) -> None:
        todo: list[tuple[OffloadKey, int]] = []
        for key, cid in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            chunk = self._chunks.get(key)
            if chunk is not None:
                chunk.readers += 1
                chunk.rank = self._fresh_rank()
                self._own(key, program_of(job_metadata.req_context))
            todo.append((key, int(cid)))
        job = job_metadata.job_id
        self._jobs[job] = self._pool.submit(self._read, job, todo)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._done = self._done, []
        out: list[JobResult] = []
        for d in done:
            self._jobs.pop(d.job_id, None)
            if d.store:
                for key in d.ok:
                    chunk = self._chunks.get(key)
                    if chunk is not None:
                        chunk.ready = True
                for key in d.failed:
                    self._remove(key)
                if d.no_space:
                    self._shrink()
                self.stats["stored_chunks"] += len(d.ok)
                self.stats["written_bytes"] += d.nbytes
                out.append(JobResult(job_id=d.job_id, success=not d.failed,
                                     transfer_time=d.seconds, transfer_bytes=d.nbytes))
            else:
                for key in (*d.ok, *d.failed, *d.torn):
                    chunk = self._chunks.get(key)
                    if chunk is not None:
                        chunk.readers = max(0, chunk.readers - 1)
                for key in (*d.failed, *d.torn):
                    self._remove(key)
                self.stats["loaded_chunks"] += len(d.ok)
                self.stats["torn_chunks"] += len(d.torn)
                self.stats["read_bytes"] += d.nbytes
                ok = not d.failed and not d.torn
                out.append(JobResult(job_id=d.job_id, success=ok,
                                     successful_keys=None if ok else list(d.ok),
                                     transfer_time=d.seconds, transfer_bytes=d.nbytes))
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        for fut in list(self._jobs.values()):
            fut.exception()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        if self._lock_fd is None:
            return  # shut down already
        shutil.rmtree(self.root, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None

    def _shrink(self) -> None:
        held = len(self._chunks)
        if held < self.max_chunks:
            if not self._warned_full:
                self._warned_full = True
                logger.warning("MORI disk tier: %s is out of space at %d of %d chunks; "
                               "the tier now holds %d and evicts in MORI's order",
                               self.root, held, self.max_chunks, held)
            self.max_chunks = held

    # -- the I/O thread --------------------------------------------------------------------
    def _finish(self, done: _Done) -> _Done:
        with self._lock:
            self._done.append(done)
        return done

    def _write(self, job: int, todo: list[tuple[OffloadKey, int]]) -> _Done:
        start = time.perf_counter()
        ok: list[OffloadKey] = []
        failed: list[OffloadKey] = []
        no_space = False
        nbytes = 0
        size = self.chunk_bytes
        for key, cid in todo:
            if no_space:
                failed.append(key)
                continue
            path = self.path_of(key)
            tmp = path.with_suffix(".tmp")
            try:
                data = encode_chunk(bytes(key), self._flat[cid * size:(cid + 1) * size])
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
                ok.append(key)
                nbytes += len(data)
            except OSError as e:
                failed.append(key)
                no_space = e.errno in (errno.ENOSPC, errno.EDQUOT)
                logger.warning("MORI disk tier: writing %s failed: %s", path, e)
                tmp.unlink(missing_ok=True)
        return self._finish(_Done(job, True, ok, failed, [], no_space,
                                  time.perf_counter() - start, nbytes))

    def _read(self, job: int, todo: list[tuple[OffloadKey, int]]) -> _Done:
        start = time.perf_counter()
        ok: list[OffloadKey] = []
        failed: list[OffloadKey] = []
        torn: list[OffloadKey] = []
        nbytes = 0
        size = self.chunk_bytes
        for key, cid in todo:
            path = self.path_of(key)
            try:
                data = path.read_bytes()
            except OSError as e:
                logger.warning("MORI disk tier: reading %s failed: %s", path, e)
                failed.append(key)
                continue
            payload = decode_chunk(bytes(key), data, size)
            if payload is None:
                logger.warning("MORI disk tier: %s is torn (size or checksum); treated "
                               "as a miss and deleted", path)
                path.unlink(missing_ok=True)
                torn.append(key)
                continue
            self._flat[cid * size:(cid + 1) * size] = payload
            ok.append(key)
            nbytes += len(data)
        return self._finish(_Done(job, False, ok, failed, torn, False,
                                  time.perf_counter() - start, nbytes))

    @staticmethod
    def _delete(paths: list[Path]) -> None:
        for path in paths:
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                logger.warning("MORI disk tier: deleting %s failed: %s", path, e)
