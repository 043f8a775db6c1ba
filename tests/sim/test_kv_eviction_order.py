"""The KV pools' eviction heaps against the straightforward order: sort every entry
that holds pages in the tier by (label rank, last access), ties in creation order, at
each eviction. Same operations, same pages everywhere, after every step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core.types import KVLabel
from mori.sim.kvcache import _CPU_RANK, _DISK_RANK, _GPU_RANK, KVEntry, KVPools

_RANKS = {"gpu": _GPU_RANK, "cpu": _CPU_RANK, "disk": _DISK_RANK}


class SortingPools(KVPools):
    """The reference: the eviction order sorted afresh from every entry each time."""

    def _victims(self, tier: str) -> Iterator[KVEntry]:
        rank = _RANKS[tier] if self.typed else None
        held = [e for e in self.entries.values()
                if self._pages(e, tier) > 0 and not e.pinned]
        return iter(sorted(held, key=lambda e: ((rank[e.label] if rank else 0),
                                                 e.last_access)))


IDS = [f"p{i}" for i in range(6)]
LABELS = list(KVLabel)

op = st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(IDS), st.integers(0, 8), st.integers(1, 12)),
    st.tuples(st.just("finish"), st.sampled_from(IDS)),
    st.tuples(st.just("write"), st.sampled_from(IDS), st.integers(0, 6)),
    st.tuples(st.just("label"), st.sampled_from(IDS), st.sampled_from(LABELS)),
    st.tuples(st.just("evict"), st.sampled_from(IDS)),
    st.tuples(st.just("drop"), st.sampled_from(IDS)),
    st.tuples(st.just("end"), st.sampled_from(IDS)),
    st.tuples(st.just("room"), st.integers(0, 30)),
)


def apply(pools: KVPools, o: tuple[object, ...], now: float) -> object:
    """One engine-like operation; returns what it answered (compared as well)."""
    kind = o[0]
    if kind == "admit":  # as EngineReplica._try_admit does it
        _, pid, keep, total = o
        assert isinstance(pid, str) and isinstance(keep, int) and isinstance(total, int)
        e = pools.entry(pid)
        if e.pinned:
            return "busy"
        pools.truncate(e, keep)
        pools.pin(e)
        if not pools.make_gpu_room(total - e.gpu, now):
            pools.unpin(e)
            return False
        got = pools.take_for_request(e, max(total, e.gpu))
        pools.touch(e, now)
        return got
    e = pools.entries.get(str(o[1])) if kind != "room" else None
    if kind == "finish" and e is not None and e.pinned:
        pools.unpin(e, now)  # writes what it reserved
    elif kind == "write" and e is not None and e.pinned:
        n = o[2]
        assert isinstance(n, int)
        pools.written(e, min(n, e.reserved))  # part of its prompt computed
    elif kind == "label" and e is not None:
        lab = o[2]
        assert isinstance(lab, KVLabel)
        pools.set_label(e, lab)
    elif kind == "evict":
        pools.evict_program_gpu(str(o[1]), now)
    elif kind == "drop" and e is not None and not e.pinned:
        pools.truncate(e, 0)
        if e.ended:
            pools.remove(e.program_id)
    elif kind == "end" and e is not None:
        pools.set_label(e, KVLabel.INACTIVE)
        pools.end(e)
        if not e.gpu and not e.cpu and not e.disk and not e.pinned:
            pools.remove(e.program_id)
    elif kind == "room":
        n = o[1]
        assert isinstance(n, int)
        return pools.make_gpu_room(n, now)
    return None


def state(pools: KVPools) -> object:
    return (pools.gpu_used, pools.cpu_used, pools.disk_used, pools.dropped_pages,
            pools.evicted_gpu_pages, pools.disk_written,
            sorted((e.program_id, e.gpu, e.cpu, e.disk, e.label, e.last_access, e.pinned,
                    e.ended) for e in pools.entries.values()))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=60), typed=st.booleans(), cpu=st.sampled_from([0, 7, 20]),
       disk=st.sampled_from([0, 0, 9, 40]), same_time=st.booleans())
def test_heaps_evict_as_the_full_sort_does(ops: list[tuple[object, ...]], typed: bool,
                                          cpu: int, disk: int, same_time: bool) -> None:
    """The same with a disk pool under the CPU pool (or, with no CPU pool, under the
    GPU): its heap against the sort too."""
    fast, ref = KVPools(24, cpu, typed, disk), SortingPools(24, cpu, typed, disk)
    for i, o in enumerate(ops):
        now = 0.0 if same_time else float(i // 3)  # ties in last access, or not
        assert apply(fast, o, now) == apply(ref, o, now), o
        assert state(fast) == state(ref), o
        fast.check()


def test_the_order_is_readable() -> None:
    pools = KVPools(30, 10, typed=True)
    for pid, label, t in (("b", KVLabel.BUSY, 0.0), ("i", KVLabel.IDLE, 2.0),
                          ("x", KVLabel.INACTIVE, 1.0), ("i2", KVLabel.IDLE, 1.0)):
        e = pools.entry(pid)
        pools.take_for_request(e, 5)
        pools.set_label(e, label)
        pools.touch(e, t)
    assert [e.program_id for e in pools.eviction_order(gpu=True)] == ["x", "i2", "i", "b"]
    pools.check()


def test_evicted_host_pages_go_to_disk_and_come_back_as_a_prefix() -> None:
    """GPU 4 pages, CPU 2 beyond them (a host tier of 6), disk 10. A program's 4 pages
    pushed out of an empty GPU all fit the host tier; once another program's 4 reserved
    pages are written, the host tier holds 2 of them beside the GPU's copies, so the
    first program's tail goes to disk (counted as written); its next request takes both
    parts back."""
    pools = KVPools(4, 2, typed=True, disk_pages=10)
    a = pools.entry("a")
    pools.pin(a)
    pools.take_for_request(a, 4)
    assert a.reserved == 4 and pools.cpu_room() == 2 + 0 + 4
    pools.unpin(a, 0.0)  # its request is over: its pages are written
    assert a.reserved == 0 and pools.unmirrored == 0
    pools.set_label(a, KVLabel.COLD)
    pools.evict_program_gpu("a", 1.0)
    assert (a.gpu, a.cpu, a.disk) == (0, 4, 0) and pools.disk_written == 0
    b = pools.entry("b")
    pools.pin(b)
    assert pools.make_gpu_room(4, 2.0)
    pools.take_for_request(b, 4)  # reserved: no copy in the host tier yet
    assert (a.cpu, a.disk) == (4, 0)
    pools.written(b, 3)  # three of b's pages computed: the host tier stores them
    assert (a.cpu, a.disk) == (3, 1) and pools.disk_written == 1
    pools.unpin(b, 2.0)  # the last one too
    assert (a.cpu, a.disk) == (2, 2) and pools.disk_written == 2
    pools.set_label(b, KVLabel.IDLE)
    pools.evict_program_gpu("b", 3.0)  # the GPU is empty again: b's 4 pages fit
    assert (b.cpu, b.disk) == (4, 0) and pools.cpu_used == 6
    pools.pin(a)
    assert pools.make_gpu_room(4, 4.0)
    assert pools.take_for_request(a, 4) == (2, 2)  # its prefix from the CPU, tail from disk
    # a's pages read from disk now have a copy in the host tier: b's tail makes room
    assert (b.cpu, b.disk) == (2, 2) and pools.disk_written == 4
    with pytest.raises(ValueError, match="reserved"):
        pools.written(a, 1)  # a reserved nothing: all its pages held KV
    pools.check()


def test_inactive_pages_are_not_written_and_a_full_disk_loses_the_least_kept() -> None:
    pools = KVPools(8, 0, typed=True, disk_pages=4)
    for pid, label in (("x", KVLabel.INACTIVE), ("c", KVLabel.COLD), ("i", KVLabel.IDLE)):
        e = pools.entry(pid)
        pools.take_for_request(e, 2)
        pools.set_label(e, label)
    pools.evict_program_gpu("x", 1.0)
    assert pools.entries["x"].disk == 0 and pools.disk_written == 0  # dropped
    pools.evict_program_gpu("c", 2.0)
    pools.evict_program_gpu("i", 3.0)
    assert pools.disk_used == 4
    b = pools.entry("b")
    pools.take_for_request(b, 2)
    pools.set_label(b, KVLabel.BUSY)
    pools.evict_program_gpu("b", 4.0)  # full: the disk drops busy, then idle, then cold
    assert [pools.entries[p].disk for p in ("c", "i", "b")] == [2, 2, 0]
    assert [e.program_id for e in pools.eviction_order("disk")] == ["i", "c"]
    pools.check()
