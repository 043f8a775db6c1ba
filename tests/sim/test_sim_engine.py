"""The simulated engine replica against hand computations with the cost model."""

from __future__ import annotations

import dataclasses

import pytest

from mori.core.costmodel import CostModel, get_preset, prefill_attn_ctx
from mori.core.types import KVLabel
from mori.sim.clock import EventLoop
from mori.sim.kvcache import KVPools
from mori.sim.replica_model import EngineReplica, SimRequest


class Recorder:
    def __init__(self) -> None:
        self.ready: list[tuple[str, float]] = []
        self.first: list[tuple[str, float]] = []
        self.done: list[tuple[str, float]] = []
        self.tokens = 0

    def kv_ready(self, req: SimRequest, now: float) -> None:
        self.ready.append((req.program_id, now))

    def first_token(self, req: SimRequest, now: float) -> None:
        self.first.append((req.program_id, now))

    def finished(self, req: SimRequest, now: float) -> None:
        self.done.append((req.program_id, now))

    def produced(self, tokens: int, now: float) -> None:
        self.tokens += tokens


def make(gpu_pages: int = 10_000, cpu_pages: int = 10_000, typed: bool = True):
    cost = CostModel(get_preset("h200-qwen3-30b-a3b"))
    loop = EventLoop()
    rec = Recorder()
    eng = EngineReplica(0, cost, loop, KVPools(gpu_pages, cpu_pages, typed), rec, typed)
    return cost, loop, rec, eng


def test_single_request_timing_matches_cost_model() -> None:
    cost, loop, rec, eng = make()
    eng.submit(SimRequest("a", prompt=1000, reuse=0, output=10, arrived=0.0))
    loop.run(100.0)
    t_prefill = cost.iteration_time(1000, prefill_attn_ctx(1000, 0), 0, 0)
    assert rec.first == [("a", pytest.approx(t_prefill))]
    # the first token comes with the prefill; 9 more decode iterations over a growing context
    t_decode = cost.decode_run_time(1, 1001, 9)
    assert rec.done == [("a", pytest.approx(t_prefill + t_decode))]
    assert rec.tokens == 10
    assert eng.stats.prefill_tokens == 1000
    eng.pools.check()


def test_long_prompt_is_chunked() -> None:
    cost, loop, rec, eng = make()
    chunk = cost.preset.chunk_size
    eng.submit(SimRequest("a", prompt=2 * chunk + 100, reuse=0, output=1, arrived=0.0))
    loop.run(100.0)
    expect = (cost.iteration_time(chunk, prefill_attn_ctx(chunk, 0), 0, 0)
              + cost.iteration_time(chunk, prefill_attn_ctx(chunk, chunk), 0, 0)
              + cost.iteration_time(100, prefill_attn_ctx(100, 2 * chunk), 0, 0))
    assert rec.first[0][1] == pytest.approx(expect)
    assert eng.stats.iterations == 3


def test_second_request_cuts_a_decode_run_at_the_iteration_boundary() -> None:
    cost, loop, rec, eng = make()
    eng.submit(SimRequest("a", prompt=100, reuse=0, output=1000, arrived=0.0))
    t1 = cost.iteration_time(100, prefill_attn_ctx(100, 0), 0, 0)
    arrive = t1 + 0.5
    loop.at(arrive, 1, eng.submit, SimRequest("b", prompt=100, reuse=0, output=1, arrived=arrive))
    loop.run(1000.0)
    # a's decode run is cut at the first boundary after `arrive`; b's prefill rides the
    # next iteration together with one decode token of a
    done = cost.decode_iters_within(1, 101, arrive - t1)
    boundary = t1 + cost.decode_run_time(1, 101, done + 1)
    ctx_a = 100 + 1 + done + 1
    t_b = boundary + cost.iteration_time(100, prefill_attn_ctx(100, 0), 1, ctx_a)
    assert dict(rec.first)["b"] == pytest.approx(t_b)
    assert rec.tokens == 1001
    # a still produces exactly its 1000 tokens
    assert [p for p, _ in rec.done] == ["b", "a"]


def test_cpu_hit_is_reloaded_over_pcie_before_prefill() -> None:
    cost, loop, rec, eng = make()
    eng.submit(SimRequest("a", prompt=6400, reuse=0, output=1, arrived=0.0))
    loop.run(10.0)
    eng.evict("a")  # to the CPU pool
    # 100 whole pages (its answer's one token is a partial page: not kept)
    assert eng.pools.entries["a"].gpu == 0 and eng.pools.entries["a"].cpu == 100
    loop.at(20.0, 1, eng.submit, SimRequest("a", prompt=7000, reuse=6400, output=1, arrived=20.0))
    loop.run(100.0)
    ready_at = rec.ready[-1][1]
    assert ready_at == pytest.approx(20.0 + cost.reload_time(6400))
    assert eng.stats.cpu_hit_tokens == 6400
    assert eng.stats.recomputed_tokens == 0
    assert eng.stats.prefill_tokens == 6400 + 600


def test_without_cpu_tier_evicted_kv_is_recomputed() -> None:
    cost, loop, rec, eng = make(cpu_pages=0, typed=False)
    eng.submit(SimRequest("a", prompt=6400, reuse=0, output=1, arrived=0.0))
    loop.run(10.0)
    eng.evict("a")
    loop.at(20.0, 1, eng.submit, SimRequest("a", prompt=7000, reuse=6400, output=1, arrived=20.0))
    loop.run(100.0)
    assert eng.stats.cpu_hit_tokens == 0
    assert eng.stats.recomputed_tokens == 6400


def _served(pools: KVPools, pid: str, pages: int, t: float) -> None:
    """A request of ``pid`` ran on ``pages`` pages and ended at ``t`` (written through)."""
    e = pools.entry(pid)
    pools.pin(e)
    assert pools.make_gpu_room(pages - e.gpu, t)
    pools.take_for_request(e, pages)
    pools.unpin(e, t)


def test_typed_eviction_order_is_reversed_between_tiers() -> None:
    pools = KVPools(gpu_pages=30, cpu_pages=10, typed=True)  # a host tier of 40 pages
    for pid, label, t in (("busy", KVLabel.BUSY, 0.0), ("idle", KVLabel.IDLE, 1.0),
                          ("gone", KVLabel.INACTIVE, 2.0)):
        _served(pools, pid, 10, t)
        pools.set_label(pools.entries[pid], label)
    # GPU: inactive first, then idle, and busy last although it is the least recent
    assert pools.make_gpu_room(10, 3.0)
    assert pools.entries["gone"].gpu == 0 and pools.entries["busy"].gpu == 10
    assert pools.make_gpu_room(20, 3.0)
    assert pools.entries["idle"].gpu == 0 and pools.entries["busy"].gpu == 10
    assert pools.cpu_used == 20  # the free GPU pages have no copy: room for both
    # a new program's 20 pages written: the host tier keeps idle, drops inactive first
    _served(pools, "new", 20, 4.0)
    assert "gone" not in pools.entries or pools.entries["gone"].cpu == 0
    assert pools.entries["idle"].cpu == 10
    # busy pushed out, then 10 more pages written: busy goes before idle on the CPU
    assert pools.make_gpu_room(10, 5.0)
    assert pools.entries["busy"].cpu == 10
    _served(pools, "newer", 10, 6.0)
    assert pools.entries["busy"].cpu == 0 and pools.entries["idle"].cpu == 10
    pools.check()


def test_a_cold_programs_waiting_request_is_admitted_after_idle_before_inactive() -> None:
    """Typed admission ranks every label (``mori.core.eviction_order``: busy, idle,
    cold, inactive); a program parked on the disk tier (cold) is admitted too."""
    cost, loop, rec, eng = make()
    eng.submit(SimRequest("first", prompt=100, reuse=0, output=2, arrived=0.0))  # runs now
    for pid, label in (("gone", KVLabel.INACTIVE), ("cold", KVLabel.COLD),
                       ("idle", KVLabel.IDLE), ("busy", KVLabel.BUSY)):
        eng.set_label(pid, label)
        eng.submit(SimRequest(pid, prompt=100, reuse=0, output=2, arrived=0.0))
    assert [r.program_id for r in eng.waiting] == ["gone", "cold", "idle", "busy"]
    eng._admit(loop.now)
    assert not eng.waiting
    assert [r.program_id for r in eng.prefill] == ["first", "busy", "idle", "cold", "gone"]
    loop.run(100.0)
    assert sorted(pid for pid, _ in rec.done) == ["busy", "cold", "first", "gone", "idle"]
    eng.pools.check()


def test_plain_lru_ignores_labels() -> None:
    pools = KVPools(gpu_pages=20, cpu_pages=0, typed=False)
    for pid, label, t in (("busy", KVLabel.BUSY, 0.0), ("idle", KVLabel.IDLE, 1.0)):
        e = pools.entry(pid)
        pools.take_for_request(e, 10)
        pools.set_label(e, label)
        pools.touch(e, t)
    assert pools.make_gpu_room(10, 2.0)
    assert pools.entries["busy"].gpu == 0 and pools.entries["idle"].gpu == 10


def test_pinned_pages_are_never_evicted() -> None:
    pools = KVPools(gpu_pages=10, cpu_pages=0, typed=False)
    e = pools.entry("a")
    pools.take_for_request(e, 10)
    pools.pin(e)
    assert not pools.make_gpu_room(1, 0.0)
    assert e.gpu == 10


def with_overhead(overhead_s: float, engine_slowdown: float = 1.0):
    preset = dataclasses.replace(get_preset("h200-qwen3-30b-a3b"),
                                 request_overhead_s=overhead_s)
    cost = CostModel(preset, engine_slowdown=engine_slowdown)
    loop = EventLoop()
    rec = Recorder()
    eng = EngineReplica(0, cost, loop, KVPools(10_000, 10_000, True), rec, True)
    return cost, loop, rec, eng


def test_the_request_overhead_is_charged_once_scaled_by_the_engine_slowdown() -> None:
    cost, loop, rec, eng = with_overhead(0.01, engine_slowdown=100.0)
    assert cost.request_overhead == pytest.approx(1.0)
    chunk = cost.preset.chunk_size
    eng.submit(SimRequest("a", prompt=chunk + 100, reuse=0, output=3, arrived=0.0))
    loop.run(1_000.0)
    t1 = cost.iteration_time(chunk, prefill_attn_ctx(chunk, 0), 0, 0)
    t2 = cost.iteration_time(100, prefill_attn_ctx(100, chunk), 0, 0)
    # on its first chunk only; the decode steps after carry none
    assert rec.first == [("a", pytest.approx(1.0 + t1 + t2))]
    assert rec.done == [("a", pytest.approx(1.0 + t1 + t2
                                            + cost.decode_run_time(1, chunk + 101, 2)))]
    assert eng.stats.busy_s == pytest.approx(rec.done[0][1])


def test_the_request_overhead_takes_the_engines_time() -> None:
    cost, loop, rec, eng = with_overhead(0.5)
    eng.submit(SimRequest("a", prompt=1000, reuse=0, output=1, arrived=0.0))
    eng.submit(SimRequest("b", prompt=500, reuse=0, output=1, arrived=0.0))
    loop.run(100.0)
    t_a = cost.iteration_time(1000, prefill_attn_ctx(1000, 0), 0, 0)
    t_b = cost.iteration_time(500, prefill_attn_ctx(500, 0), 0, 0)
    # b, queued behind a, waits for a's overhead as well as its compute
    assert rec.first == [("a", pytest.approx(0.5 + t_a)), ("b", pytest.approx(1.0 + t_a + t_b))]
    assert eng.stats.busy_s == pytest.approx(1.0 + t_a + t_b)


def test_a_negative_request_overhead_is_refused() -> None:
    with pytest.raises(ValueError, match="request_overhead_s"):
        dataclasses.replace(get_preset("h200-qwen3-30b-a3b"), request_overhead_s=-0.001)


def test_a_long_prefill_writes_its_pages_through_as_it_goes() -> None:
    """While a prompt is prefilled in chunks, the host tier holds CPU-only pages in the
    room of its pages not computed yet; each chunk written takes that room back, and
    the CPU pool evicts as the host tier does when it stores a block."""
    cost, loop, rec, eng = make(gpu_pages=400, cpu_pages=100, typed=False)
    chunk, page = cost.preset.chunk_size, cost.preset.page_tokens  # 8,192 and 64
    eng.submit(SimRequest("old", prompt=300 * page, reuse=0, output=1, arrived=0.0))
    loop.run(100.0)
    eng.evict("old")  # its 300 pages to the CPU pool: the empty GPU leaves room for all
    pools = eng.pools
    assert pools.entries["old"].cpu == 300 and pools.cpu_room() == 100 + 400
    eng.submit(SimRequest("new", prompt=3 * chunk, reuse=0, output=1, arrived=loop.now))
    seen: list[tuple[int, int, int]] = []  # (new's reserved, new's GPU, old's CPU pages)
    while not rec.done or rec.done[-1][0] != "new":
        loop.run(loop.now + 1e-3)
        new = pools.entries.get("new")
        if new is not None:
            state = (new.reserved, new.gpu, pools.entries["old"].cpu)
            if not seen or seen[-1] != state:
                seen.append(state)
            assert pools.cpu_used <= pools.cpu_room()
            pools.check()
    assert seen == [
        (385, 385, 300),  # admitted: 3 chunks of 128 pages and 1 for its answer, reserved
        (257, 385, 300),  # a chunk written: room 100 + 15 + 257 still holds the old 300
        (129, 385, 244),  # another: 100 + 15 + 129
        (0, 384, 116),  # done: its partial last page freed, the rest written: 100 + 16
    ]
    assert eng.stats.cpu_hit_tokens == 0


def test_a_finished_request_keeps_only_whole_pages() -> None:
    """Engines cache whole blocks: the last partial page of a request is not kept."""
    cost, loop, rec, eng = make()
    page = cost.preset.page_tokens
    eng.submit(SimRequest("a", prompt=3 * page + 10, reuse=0, output=5, arrived=0.0))
    loop.run(100.0)
    assert rec.done and eng.pools.entries["a"].gpu == 3  # 3 pages + 15 tokens computed
    eng.pools.check()


def test_a_reload_on_the_engine_takes_engine_time_not_the_link() -> None:
    """``reload_on_engine`` (the CPU build copies its host tier on its own CPU): the
    request is ready at once and the copy lengthens the iteration that starts it."""
    preset = dataclasses.replace(get_preset("h200-qwen3-30b-a3b"), reload_on_engine=True)
    cost = CostModel(preset)
    loop, rec = EventLoop(), Recorder()
    eng = EngineReplica(0, cost, loop, KVPools(10_000, 10_000, True), rec, True)
    eng.submit(SimRequest("a", prompt=6400, reuse=0, output=1, arrived=0.0))
    loop.run(10.0)
    eng.evict("a")
    loop.at(20.0, 1, eng.submit, SimRequest("a", prompt=7000, reuse=6400, output=1, arrived=20.0))
    loop.run(100.0)
    assert rec.ready[-1] == ("a", 20.0)  # no wait for a link
    first = dict(rec.first)["a"] if len(rec.first) == 1 else rec.first[-1][1]
    expect = 20.0 + cost.reload_time(6400) + cost.iteration_time(
        600, prefill_attn_ctx(600, 6400), 0, 0)
    assert first == pytest.approx(expect)
    assert eng.stats.cpu_hit_tokens == 6400 and eng.stats.recomputed_tokens == 0
