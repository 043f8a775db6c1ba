"""The KV pools' eviction heaps against the straightforward order: sort every entry
that holds pages in the tier by (label rank, last access), ties in creation order, at
each eviction. Same operations, same pages everywhere, after every step."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core.types import KVLabel
from mori.sim.kvcache import _CPU_RANK, _GPU_RANK, KVEntry, KVPools


class SortingPools(KVPools):
    """The reference: the eviction order sorted afresh from every entry each time."""

    def _victims(self, gpu: bool) -> Iterator[KVEntry]:
        rank = (_GPU_RANK if gpu else _CPU_RANK) if self.typed else None
        held = [e for e in self.entries.values()
                if (e.gpu if gpu else e.cpu) > 0 and not e.pinned]
        return iter(sorted(held, key=lambda e: ((rank[e.label] if rank else 0),
                                                 e.last_access)))


IDS = [f"p{i}" for i in range(6)]
LABELS = list(KVLabel)

op = st.one_of(
    st.tuples(st.just("admit"), st.sampled_from(IDS), st.integers(0, 8), st.integers(1, 12)),
    st.tuples(st.just("finish"), st.sampled_from(IDS)),
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
        pools.unpin(e, now)
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
        if not e.gpu and not e.cpu and not e.pinned:
            pools.remove(e.program_id)
    elif kind == "room":
        n = o[1]
        assert isinstance(n, int)
        return pools.make_gpu_room(n, now)
    return None


def state(pools: KVPools) -> object:
    return (pools.gpu_used, pools.cpu_used, pools.dropped_pages, pools.evicted_gpu_pages,
            sorted((e.program_id, e.gpu, e.cpu, e.label, e.last_access, e.pinned, e.ended)
                   for e in pools.entries.values()))


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op, max_size=60), typed=st.booleans(), cpu=st.sampled_from([0, 7, 20]),
       same_time=st.booleans())
def test_heaps_evict_as_the_full_sort_does(ops: list[tuple[object, ...]], typed: bool,
                                          cpu: int, same_time: bool) -> None:
    fast, ref = KVPools(24, cpu, typed), SortingPools(24, cpu, typed)
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
