"""MORI's CPU tier (``mori.vllm_plugin.cpu_tier``) against vLLM's real offloading classes:
the cache policy driven by ``CPUOffloadingManager`` as the connector drives it, the host
copy worker's byte layout, and the host spec built by vLLM's own connector."""

from __future__ import annotations

import inspect
import mmap
import random
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm.config import (
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
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
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from mori.vllm_plugin import compat, connector_config, cpu_tier
from mori.vllm_plugin.cpu_tier import MoriCachePolicy
from mori.vllm_plugin.host_tier import HostCopyOffloadingWorker, MoriHostOffloadingSpec

from .conftest import ENGINE_BLOCK, ENGINE_BLOCKS, engine_configs, engine_side, tiny_model_dir

MODULE = "mori.vllm_plugin.cpu_tier"
HOST_MODULE = "mori.vllm_plugin.host_tier"
_req_ids = iter(range(1_000_000))


# -- the policy, through vLLM's CPUOffloadingManager -------------------------------------
def make_manager(num_chunks: int, policy: str = "MoriCachePolicy") -> CPUOffloadingManager:
    return CPUOffloadingManager(
        num_chunks=num_chunks, cache_policy=policy,
        cache_policy_module_path=MODULE if policy == "MoriCachePolicy" else None)


def policy_of(mgr: CPUOffloadingManager) -> MoriCachePolicy:
    pol = mgr._policy
    assert isinstance(pol, MoriCachePolicy)
    return pol


def key(name: str, group: int = 0) -> OffloadKey:
    return make_offload_key(name.encode().ljust(32, b"\0"), group)


def keys(prefix: str, n: int) -> list[OffloadKey]:
    return [key(f"{prefix}{i}") for i in range(n)]


def ctx(program: str | None) -> ReqContext:
    params = {cpu_tier.PROGRAM_KEY: program} if program is not None else None
    return ReqContext(req_id=f"r{next(_req_ids)}", kv_transfer_params=params)


def store(mgr: CPUOffloadingManager, program: str | None, ks: list[OffloadKey], *,
          finish: bool = True, context: ReqContext | None = None) -> list[OffloadKey]:
    """One request storing ``ks`` (a prefix, head first) as the connector does; returns
    the keys evicted to make room."""
    c = ctx(program) if context is None else context
    mgr.on_new_request(c)
    out = mgr.prepare_store(ks, c)
    assert out is not None, "the tier could not make room"
    mgr.complete_store(out.keys_to_store, c)
    if finish:
        mgr.on_request_finished(c)
    return list(out.evicted_keys)


def hits(mgr: CPUOffloadingManager, ks: Iterable[OffloadKey]) -> list[bool]:
    return [mgr.lookup(k, ReqContext("probe")) == LookupResult.HIT for k in ks]


def labelled(labels: dict[str, str]) -> Any:
    return lambda program: labels.get(program, "busy")


def test_a_requests_program_from_its_kv_hints() -> None:
    # the program as the gateway sends it to an engine that reads kv_hints from a body,
    # in vLLM's own structs: the policy classes the chunks without the MORI scheduler
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    from mori.plugin_channel import kv_hints
    env = kv_hints.envelope("agent", "busy", "m1")
    hints = KvHintsEnvelope(protocol_version=env["protocol_version"],
                            message_id=env["message_id"],
                            actions=[KvHintAction(**a) for a in env["actions"]])
    c = ReqContext(req_id="h1", kv_hints=hints)
    assert cpu_tier.program_of(c) == "agent"
    # kv_transfer_params (the scheduler's copy of session_id) comes first
    c2 = ReqContext(req_id="h2", kv_transfer_params={cpu_tier.PROGRAM_KEY: "other"},
                    kv_hints=hints)
    assert cpu_tier.program_of(c2) == "other"
    # another orchestrator's action is not MORI's
    foreign = KvHintsEnvelope(protocol_version="1", message_id="m2", actions=[KvHintAction(
        action_id="x", action_type="pin", action_version="1", payload={"program": "p"})])
    assert cpu_tier.program_of(ReqContext(req_id="h3", kv_hints=foreign)) is None
    assert cpu_tier.program_of(ReqContext(req_id="h4")) is None

    mgr = make_manager(4)
    pol = policy_of(mgr)
    pol.bind(labelled({"agent": "inactive"}))
    stored = keys("k", 2)
    store(mgr, None, stored, context=ReqContext(req_id="h5", kv_hints=hints))
    assert all(pol.programs_of(k) == {"agent"} for k in stored)
    assert all(pol.class_of(k) == "inactive" for k in stored)


def test_evicts_inactive_then_busy_then_idle_lru_within() -> None:
    mgr = make_manager(6)
    labels = {"A": "idle", "B": "busy", "C": "inactive"}
    policy_of(mgr).bind(labelled(labels))
    for p in "ABC":  # A oldest, C newest
        assert store(mgr, p, keys(p, 2)) == []
    # inactive first, although C is the most recent
    assert set(store(mgr, "D", keys("D", 2))) == set(keys("C", 2))
    # then busy, LRU: B (older than D; a prefix's tail before its head), then D's tail
    assert store(mgr, "E", keys("E", 3)) == [key("B1"), key("B0"), key("D1")]
    assert hits(mgr, keys("A", 2)) == [True, True]  # idle kept longest
    assert policy_of(mgr).evicted_by_class == {"inactive": 2, "cold": 0, "busy": 3, "idle": 0}


def test_a_cold_programs_chunks_go_after_the_inactive_before_the_busy() -> None:
    # cold: MORI parked the program on the disk tier, which holds its chunks
    mgr = make_manager(6)
    policy_of(mgr).bind(labelled({"A": "cold", "B": "busy", "C": "inactive"}))
    for p in "CAB":  # C oldest, B newest
        assert store(mgr, p, keys(p, 2)) == []
    assert set(store(mgr, "D", keys("D", 2))) == set(keys("C", 2))
    assert set(store(mgr, "E", keys("E", 2))) == set(keys("A", 2))
    assert hits(mgr, keys("B", 2)) == [True, True]
    assert policy_of(mgr).evicted_by_class["cold"] == 2


def test_unlabelled_chunks_count_as_busy() -> None:
    mgr = make_manager(6)
    pol = policy_of(mgr)
    pol.bind(labelled({"X": "idle", "Y": "inactive"}))
    store(mgr, None, keys("N", 2))  # no program at all: the oldest
    store(mgr, "X", keys("X", 2))
    store(mgr, "U", keys("U", 2))  # a program without a label: the newest
    for k in keys("N", 2) + keys("U", 2):
        assert pol.class_of(k) == "busy"
    assert pol.sizes() == {"inactive": 0, "cold": 0, "busy": 4, "idle": 2}
    assert set(store(mgr, "Y", keys("Y", 4))) == set(keys("N", 2) + keys("U", 2))
    assert hits(mgr, keys("X", 2)) == [True, True]


def offer(mgr: CPUOffloadingManager, c: ReqContext, ks: list[OffloadKey],
          load: list[OffloadKey], touch: bool) -> Any:
    """One step of a request as the connector drives it: load ``load`` (hits), touch
    ``ks`` if asked (where the manager has ``touch``: 0.32, 0.33), offer ``ks`` for
    storing; what the store did (or ``None``)."""
    if load:
        mgr.prepare_load(load, c)
    if touch and hasattr(mgr, "touch"):  # vLLM 0.34 has no touch: recency at finish
        mgr.touch(ks, c)
    out = mgr.prepare_store(ks, c)
    if out is not None:
        mgr.complete_store(out.keys_to_store, c)
    if load:
        mgr.complete_load(load, c)
    return None if out is None else (out.keys_to_store, out.evicted_keys)


def test_unbound_policy_evicts_exactly_as_vllms_lru() -> None:
    """Same offers, loads and touches to vLLM's LRU and to the unbound MORI policy (every
    chunk busy): the same evictions at every step."""
    rng = random.Random(7)
    lru, mori = make_manager(12, "lru"), make_manager(12)
    assert not policy_of(mori).bound
    for step in range(300):
        program = rng.choice(["p", "q", "r", "s", None])
        prefix = rng.choice("abcdefgh")
        ks = keys(prefix, rng.randint(1, 5))
        a, b = ctx(program), ctx(program)
        for mgr, c in ((lru, a), (mori, b)):
            mgr.on_new_request(c)
        ready = [k for k in ks if lru.lookup(k, a) == LookupResult.HIT]
        assert ready == [k for k in ks if mori.lookup(k, b) == LookupResult.HIT]
        outs = []
        for mgr, c in ((lru, a), (mori, b)):
            outs.append(offer(mgr, c, ks, ready if step % 3 == 0 else [], step % 5 == 0))
            mgr.on_request_finished(c)
        assert outs[0] == outs[1], f"step {step}: LRU {outs[0]}, MORI {outs[1]}"


CONTEXT_AT_INSERT = "req_context" in inspect.signature(CachePolicy.insert).parameters
CHUNK_TOKENS = 16  # the end-token positions the tests give keys: chunk i ends at 16 (i+1)


def positioned(c: ReqContext, ks: list[OffloadKey], first: int = 0) -> None:
    """Set ``ks``' end-token positions in ``c`` as the offloading scheduler does: the
    chunk at prefix index ``first + i`` ends at token ``CHUNK_TOKENS * (first + i + 1)``."""
    for i, k in enumerate(ks):
        c.set_offload_key_position(k, CHUNK_TOKENS * (first + i + 1))


def test_an_unfinished_requests_chunks_go_in_the_installed_lrus_order() -> None:
    """Four chunks of a request still in progress, stored with their positions, one to
    evict. vLLM 0.33's LRU gives them one rank, tail first: it evicts a3. 0.32's ranks them
    by insertion: a0. The unbound MORI policy evicts what the installed LRU evicts."""
    lru, mori = make_manager(4, "lru"), make_manager(4)
    evicted = []
    for mgr in (lru, mori):
        c = ctx("A")
        positioned(c, keys("a", 4))
        store(mgr, "A", keys("a", 4), finish=False, context=c)
        evicted.append(store(mgr, None, keys("x", 1)))
    assert evicted[0] == evicted[1] == [key("a3") if CONTEXT_AT_INSERT else key("a0")]


def test_the_store_path_fits_the_installed_managers_insert_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33's manager calls ``insert(key, chunk, req_context)``. The policy of 0.32,
    ``insert(key, chunk)``, raised ``TypeError`` on the first store (the engine died with
    "EngineCore encountered a fatal error"). That old policy, loaded past the start-up
    check, still fails so; the check refuses it at construction instead; the current
    policy stores, and takes the chunk's program from the insert's context."""

    class Old032Policy(MoriCachePolicy):
        def insert(self, key: OffloadKey, chunk: Any) -> None:  # type: ignore[override]
            super().insert(key, chunk)

    if CONTEXT_AT_INSERT:
        with pytest.raises(compat.UnsupportedVllm, match=r"CachePolicy\.insert now takes"):
            Old032Policy(4)
    else:
        Old032Policy(4)  # the 0.32 manager calls insert(key, chunk): it fits
    mgr = make_manager(4)
    with monkeypatch.context() as m:
        m.setattr(cpu_tier.compat, "check", lambda *a, **k: None)
        mgr._policy = Old032Policy(4)
    if CONTEXT_AT_INSERT:
        with pytest.raises(TypeError, match="positional argument"):
            store(mgr, "A", keys("A", 1))
    else:
        store(mgr, "A", keys("A", 1))

    mgr = make_manager(4)
    pol = policy_of(mgr)
    calls: list[int] = []
    real = pol.insert

    def spy(*args: Any) -> None:
        calls.append(len(args))
        real(*args)

    monkeypatch.setattr(pol, "insert", spy)
    monkeypatch.setattr(pol, "on_store_miss", lambda keys, req_context: None)
    store(mgr, "A", keys("A", 2), finish=False)
    assert calls == [3, 3] if CONTEXT_AT_INSERT else [2, 2]
    # the owner came from insert's context (0.33), with on_store_miss silenced
    assert pol.programs_of(key("A0")) == ({"A"} if CONTEXT_AT_INSERT else frozenset())


def test_unbound_policy_follows_the_lru_with_requests_in_progress() -> None:
    """Requests that store their prefix over several steps, with positions set, some
    reusing others' chunks, loading, touching, finishing late: the unbound MORI policy and
    the installed vLLM's LRU evict the same chunks at every step."""
    rng = random.Random(11)
    lru, mori = make_manager(10, "lru"), make_manager(10)
    live: list[dict[str, Any]] = []
    for step in range(600):
        if len(live) < 3 and (not live or rng.random() < 0.3):
            program = rng.choice(["p", "q", "r", None])
            prefix = keys(rng.choice("abcdef"), rng.randint(2, 7))
            pair = (ctx(program), ctx(program))
            for mgr, c in zip((lru, mori), pair, strict=True):
                positioned(c, prefix)
                mgr.on_new_request(c)
            live.append({"keys": prefix, "at": 0, "ctx": pair})
            continue
        req = rng.choice(live)
        if req["at"] >= len(req["keys"]) or rng.random() < 0.1:
            for mgr, c in zip((lru, mori), req["ctx"], strict=True):
                mgr.on_request_finished(c)
            live.remove(req)
            continue
        batch = req["keys"][req["at"]:req["at"] + rng.randint(1, 3)]
        req["at"] += len(batch)
        outs = []
        for mgr, c in zip((lru, mori), req["ctx"], strict=True):
            ready = [k for k in batch if mgr.lookup(k, c) == LookupResult.HIT]
            outs.append(offer(mgr, c, batch, ready if step % 2 == 0 else [], step % 7 == 0))
        assert outs[0] == outs[1], f"step {step}: LRU {outs[0]}, MORI {outs[1]}"
    assert policy_of(mori).num_chunks == len(lru._policy.chunks)


def test_relabelling_resorts_the_stored_chunks() -> None:
    mgr = make_manager(6)
    pol = policy_of(mgr)
    labels = {"A": "idle", "B": "busy", "C": "busy"}
    pol.bind(labelled(labels))
    for p in "ABC":
        store(mgr, p, keys(p, 2))
    labels["A"] = "inactive"
    assert pol.relabel(["A"]) == 2
    assert pol.relabel(["A"]) == 0  # nothing left to move
    assert set(store(mgr, "D", keys("D", 2))) == set(keys("A", 2))
    labels.update(B="idle", C="inactive")  # a replace: everything may have changed
    assert pol.relabel_all() == 4
    assert set(store(mgr, "E", keys("E", 2))) == set(keys("C", 2))
    assert hits(mgr, keys("B", 2)) == [True, True]


def test_a_dropped_programs_own_chunks_go_first() -> None:
    mgr = make_manager(4)
    pol = policy_of(mgr)
    labels = {"A": "idle", "B": "idle", "C": "busy"}
    pol.bind(labelled(labels))
    store(mgr, "A", [key("P0"), key("A1")])
    store(mgr, "B", [key("P0"), key("B1")])  # P0 shared with A
    store(mgr, "C", keys("C", 1))
    del labels["A"]  # the gateway dropped A: its label is gone (busy) ...
    assert pol.drop("A") == 1  # ... and A1, A's alone, is inactive
    assert pol.drop("A") == 0
    assert pol.class_of(key("A1")) == "inactive"
    assert pol.class_of(key("P0")) == "idle" and pol.programs_of(key("P0")) == {"B"}
    assert store(mgr, None, keys("X", 1)) == [key("A1")]  # before C's busy chunk
    # A's next request makes its chunks A's again
    store(mgr, "A", [key("P0"), key("A2")])
    assert pol.class_of(key("A2")) == "busy" and "A" in pol.programs_of(key("P0"))
    assert "A" in pol.programs_of(key("A2"))


def test_a_mirror_only_tier_keeps_demoted_programs_chunks_by_recency() -> None:
    # a host tier no larger than the GPU pool: the gateway parks nothing there, and a
    # program it demoted (inactive) is the one whose host copy can save a recompute
    mgr = make_manager(6)
    pol = policy_of(mgr)
    labels = {"A": "busy", "B": "busy", "C": "busy", "X": "busy"}
    pol.bind(labelled(labels))
    pol.set_mirror_only(True)
    for p in "ABC":  # A oldest, C newest
        store(mgr, p, keys(p, 2))
    labels["A"] = "inactive"
    pol.relabel(["A"])  # A turned inactive: its chunks are renewed, not sent first
    assert pol.class_of(key("A0")) == "busy"
    assert set(store(mgr, "D", keys("D", 2))) == set(keys("B", 2))  # now the oldest
    pol.relabel(["A"])  # still inactive: renewed once only
    assert set(store(mgr, "E", keys("E", 2))) == set(keys("C", 2))
    assert set(store(mgr, "F", keys("F", 2))) == set(keys("A", 2))
    # a chunk no program owns any more (drop) still goes first
    store(mgr, "X", keys("X", 1))
    assert pol.drop("X") == 1
    assert store(mgr, "G", keys("G", 1)) == [key("X0")]
    # the same tier not mirror-only: the inactive program's chunks go first
    pol.set_mirror_only(False)
    labels["F"] = "inactive"
    pol.relabel(["F"])
    assert set(store(mgr, "H", keys("H", 2))) == set(keys("F", 2))


def test_a_mirror_only_tier_renews_a_program_each_time_it_turns_inactive() -> None:
    mgr = make_manager(4)
    pol = policy_of(mgr)
    labels = {"A": "inactive", "B": "busy"}
    pol.bind(labelled(labels))
    pol.set_mirror_only(True)
    store(mgr, "A", keys("A", 2))
    store(mgr, "B", keys("B", 2))
    labels["A"] = "busy"
    pol.relabel(["A"])
    labels["A"] = "inactive"  # demoted again: renewed again
    pol.relabel(["A"])
    assert set(store(mgr, "C", keys("C", 2))) == set(keys("B", 2))


def test_a_chunk_being_loaded_is_never_evicted() -> None:
    mgr = make_manager(4)
    pol = policy_of(mgr)
    labels = {"F": "busy"}
    pol.bind(labelled(labels))
    store(mgr, "F", keys("F", 2))
    store(mgr, "G", keys("G", 2))
    loading = ctx("F")
    mgr.on_new_request(loading)
    mgr.prepare_load([key("F0")], loading)  # ref_cnt 1: not evictable
    labels["F"] = "inactive"
    pol.relabel(["F"])
    assert store(mgr, "H", keys("H", 2)) == [key("F1"), key("G1")]
    assert hits(mgr, [key("F0")]) == [True]
    mgr.complete_load([key("F0")], loading)
    mgr.on_request_finished(loading)
    assert pol.class_of(key("F0")) == "inactive"
    assert store(mgr, "I", keys("I", 1)) == [key("F0")]  # evictable again: first to go


def test_evict_is_atomic_and_skips_protected_chunks() -> None:
    mgr = make_manager(3)
    pol = policy_of(mgr)
    pol.bind(labelled({"A": "inactive", "B": "idle"}))
    store(mgr, "A", keys("A", 2))
    store(mgr, "B", keys("B", 1))
    assert pol.evict(3, {key("A0")}) is None  # only 2 candidates left: nothing changes
    assert pol.num_chunks == 3 and pol.sizes() == {"inactive": 2, "cold": 0, "busy": 0, "idle": 1}
    got = pol.evict(2, {key("A0")})
    assert got is not None and [k for k, _ in got] == [key("A1"), key("B0")]
    assert pol.evict(0, set()) == []


def test_chunks_are_classed_from_their_store_on() -> None:
    """A chunk is its program's from insertion (on_store_miss), not only once the request
    finishes."""
    mgr = make_manager(4)
    policy_of(mgr).bind(labelled({"B": "busy", "C": "inactive"}))
    store(mgr, "B", keys("B", 2))
    store(mgr, "C", keys("C", 2), finish=False)  # still running
    assert set(store(mgr, "D", keys("D", 2))) == set(keys("C", 2))


def test_a_shared_chunk_takes_its_most_protective_label() -> None:
    mgr = make_manager(3)
    pol = policy_of(mgr)
    pol.bind(labelled({"A": "inactive", "B": "idle"}))
    store(mgr, "A", [key("P0"), key("A1")])
    store(mgr, "B", [key("P0"), key("B1")])  # reuses A's first chunk
    assert pol.programs_of(key("P0")) == {"A", "B"}
    assert pol.class_of(key("P0")) == "idle"
    # A1 (inactive) first; then the idle ones, LRU: B1 (B's tail) before P0
    assert store(mgr, None, keys("X", 2)) == [key("A1"), key("B1")]
    assert hits(mgr, [key("P0")]) == [True]


def test_a_widely_shared_chunk_is_kept_as_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_tier, "MAX_PROGRAMS_PER_BLOCK", 2)
    mgr = make_manager(4)
    pol = policy_of(mgr)
    pol.bind(lambda program: "inactive")
    for p in "abc":
        store(mgr, p, [key("W0"), key(f"{p}1")])
    assert store(mgr, "d", [key("W0"), key("d1")]) == [key("a1")]
    assert pol.class_of(key("W0")) == "idle"
    assert pol.class_of(key("b1")) == "inactive"
    unbound = make_manager(4)  # unbound, every chunk is busy, wide ones included
    for p in "abc":
        store(unbound, p, [key("W0"), key(f"{p}1")])
    assert policy_of(unbound).class_of(key("W0")) == "busy"


def test_a_failing_label_lookup_counts_as_busy() -> None:
    mgr = make_manager(4)
    pol = policy_of(mgr)

    def broken(program: str) -> str:
        raise RuntimeError("label table gone")

    pol.bind(broken)
    store(mgr, "A", keys("A", 2))
    assert pol.class_of(key("A0")) == "busy"
    pol.bind(lambda program: "no such label")
    assert pol.class_of(key("A0")) == "busy"


def test_reset_cache_clears_the_policy() -> None:
    mgr = make_manager(4)
    pol = policy_of(mgr)
    pol.bind(labelled({"A": "inactive"}))
    store(mgr, "A", keys("A", 3))
    store(mgr, "B", keys("B", 1), finish=False)
    mgr.reset_cache()
    assert pol.num_chunks == 0 and pol.sizes() == dict.fromkeys(cpu_tier.EVICT_ORDER, 0)
    assert pol.programs_of(key("A0")) == frozenset()
    assert store(mgr, "C", keys("C", 4)) == []
    assert pol in cpu_tier.live_policies()


# -- the host copy worker -------------------------------------------------------------------
def caches(num_blocks: int, page: int, refs: list[list[tuple[int, int]]],
           num_tensors: int = 2) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randint(-128, 128, (num_blocks, page), dtype=torch.int8, generator=gen)
          for _ in range(num_tensors)]
    return ts, CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t in ts],
        [[CanonicalKVCacheRef(i, size) for i, size in group] for group in refs])


def test_copy_worker_round_trip_with_a_sub_block_skip() -> None:
    page, bpc = 64, 2
    ts, kv = caches(10, page, [[(0, page), (1, page)]])
    w = HostCopyOffloadingWorker(kv, blocks_per_chunk=bpc, num_chunks=4)
    assert [h.shape for h in w.host] == [(4, page * bpc)] * 2
    # blocks 3, 4, 5 are a request's blocks 1, 2, 3: block 1 is the second half of a chunk
    assert w.submit_store(7, engine_side(GPULoadStoreSpec([3, 4, 5], [3], [1]), kv),
                          CPULoadStoreSpec([2, 0]))
    for t in range(2):  # chunk 2 = (request block 0: untouched, block 1), chunk 0 = (2, 3)
        assert torch.equal(w.host[t][2, page:], ts[t][3])
        assert torch.equal(w.host[t][0], torch.cat([ts[t][4], ts[t][5]]))
        assert not w.host[t][2, :page].any()
    orig = [t[[3, 4, 5]].clone() for t in ts]
    for t in ts:
        t[3:6] = 0
    assert w.submit_load(8, CPULoadStoreSpec([2, 0]),
                         engine_side(GPULoadStoreSpec([6, 7, 8], [3], [1]), kv))
    for t, o in zip(ts, orig, strict=True):
        assert torch.equal(t[6:9], o)
        assert not t[3:6].any()  # the load wrote only its destination blocks
    res = w.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in res] == [
        (7, True, 3 * 2 * page), (8, True, 3 * 2 * page)]
    assert w.get_finished() == []
    w.wait({7, 8})


def test_copy_worker_groups_copy_their_own_tensors() -> None:
    """Two groups (the second on tensor 1 only, with an un-padded page of 48 bytes): each
    group's blocks go to its own chunks, with its own skip; an empty group is skipped."""
    page, bpc = 64, 4
    ts, kv = caches(12, page, [[(0, page), (1, page)], [(1, 48)], [(0, page)]])
    w = HostCopyOffloadingWorker(kv, blocks_per_chunk=bpc, num_chunks=3)
    spec = GPULoadStoreSpec([1, 2, 9], [2, 1, 0], [0, 6, 0])
    assert w.submit_store(1, engine_side(spec, kv), CPULoadStoreSpec([0, 1]))
    host0 = [h.view(3 * bpc, page) for h in w.host]
    for t in range(2):
        assert torch.equal(host0[t][0], ts[t][1]) and torch.equal(host0[t][1], ts[t][2])
    assert torch.equal(host0[1][1 * bpc + 2], ts[1][9])  # group 1, skip 6 % 4
    assert not host0[0][1 * bpc + 2].any()  # group 1 does not touch tensor 0
    (res,) = w.get_finished()
    assert res.transfer_size == 2 * (2 * page) + 1 * 48


def test_copy_worker_refuses_a_mismatched_transfer() -> None:
    _, kv = caches(4, 64, [[(0, 64)]], num_tensors=1)
    w = HostCopyOffloadingWorker(kv, blocks_per_chunk=2, num_chunks=2)
    with pytest.raises(ValueError, match="does not match"):
        w.submit_store(1, engine_side(GPULoadStoreSpec([0, 1], [2], [0]), kv),
                       CPULoadStoreSpec([0, 1]))


def test_copy_worker_reads_device_pointers_and_refuses_stray_ones() -> None:
    """vLLM 0.34 hands the engine side of a transfer as ``DevicePointers``: an address per
    block and data reference, group by group. The copy worker turns them back into block
    ids (the same copies as from the 0.32/0.33 spec) and refuses, before any byte moves, an
    address that is not a block of the tensor its reference names."""
    page, bpc = 64, 2
    ts, kv = caches(10, page, [[(0, page), (1, page)]])

    def pointers(ids: list[int], first: int, shift: dict[int, int] | None = None) -> Any:
        ptrs = np.array([t.data_ptr() + b * page for t in ts for b in ids], dtype=np.uint64)
        for i, by in (shift or {}).items():
            ptrs[i] = int(ptrs[i]) + by
        return SimpleNamespace(ptrs=ptrs, sizes=np.full(len(ptrs), page, dtype=np.uint64),
                               group_block_counts=(len(ids),), group_data_ref_counts=(2,),
                               block_indices=(first,))

    resolved = engine_side(GPULoadStoreSpec([3, 4, 5], [3], [1]), kv)
    if hasattr(resolved, "ptrs"):  # the installed vLLM resolves them: the same layout
        made = pointers([3, 4, 5], 1)
        assert np.array_equal(resolved.ptrs, made.ptrs)
        assert (tuple(resolved.group_block_counts), tuple(resolved.group_data_ref_counts),
                tuple(resolved.block_indices)) == (
            made.group_block_counts, made.group_data_ref_counts, made.block_indices)
    w = HostCopyOffloadingWorker(kv, blocks_per_chunk=bpc, num_chunks=4)
    assert w.submit_store(7, pointers([3, 4, 5], 1), CPULoadStoreSpec([2, 0]))
    for t in range(2):
        assert torch.equal(w.host[t][2, page:], ts[t][3])
        assert torch.equal(w.host[t][0], torch.cat([ts[t][4], ts[t][5]]))
    orig = [t[[3, 4, 5]].clone() for t in ts]
    assert w.submit_load(8, CPULoadStoreSpec([2, 0]), pointers([6, 7, 8], 1))
    for t, o in zip(ts, orig, strict=True):
        assert torch.equal(t[6:9], o)
    assert [r.transfer_size for r in w.get_finished()] == [3 * 2 * page] * 2
    before = [h.clone() for h in w.host]
    for bad, why in (({2: 1}, "not a block"), ({5: 64 * page}, "not a block"),
                     ({4: page}, "point at different blocks")):
        with pytest.raises(ValueError, match=why):
            w.submit_store(9, pointers([3, 4, 5], 1, bad), CPULoadStoreSpec([2, 0]))
    assert all(torch.equal(h, b) for h, b in zip(w.host, before, strict=True))
    assert w.get_finished() == []


# -- the host spec, built by vLLM's own connector ------------------------------------------
BLOCK = ENGINE_BLOCK
NUM_BLOCKS = ENGINE_BLOCKS
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PAGE = 2 * BLOCK * 1 * 64 * 4  # K and V, 1 KV head of 64 floats: bytes per block per layer


def offloading_configs(model_dir: Path, kv_transfer: dict[str, Any]
                       ) -> tuple[VllmConfig, KVCacheConfig]:
    return engine_configs(model_dir, LAYERS, kv_transfer)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.mark.parametrize("cpu_bytes, block_size", [
    (1 << 20, None), (1 << 20, 2 * BLOCK), (3 * (1 << 20) + 5, 4 * BLOCK)])
def test_host_spec_sizes_the_tier_from_cpu_bytes(model_dir: Path, cpu_bytes: int,
                                                 block_size: int | None) -> None:
    vc, kvc = offloading_configs(
        model_dir, connector_config.kv_transfer_config(cpu_bytes, block_size=block_size))
    # what OffloadingConnector.__init__ does
    # (vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py:87-89)
    spec = OffloadingSpecFactory.create_spec(build_offloading_config(vc, kvc))
    assert isinstance(spec, MoriHostOffloadingSpec)
    bpc = (block_size or BLOCK) // BLOCK
    chunk_bytes = -(-(PAGE * len(LAYERS) * bpc) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert spec.blocks_per_chunk == bpc
    assert spec.num_chunks == cpu_bytes // chunk_bytes
    assert spec.cpu_tier_tokens == spec.num_chunks * bpc * BLOCK
    assert spec.offload_prompt_only is False
    conn = OffloadingConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    pol = conn.connector_scheduler.manager._policy
    assert isinstance(pol, MoriCachePolicy) and pol.cache_capacity == spec.num_chunks
    assert pol in cpu_tier.live_policies()


def test_host_spec_worker_copies_the_registered_kv_caches(model_dir: Path) -> None:
    """The connector's worker side, on the CPU build, gets the copy worker over the KV
    cache tensors it registers (the CPU attention layout), and the copies reach them."""
    vc, kvc = offloading_configs(model_dir, connector_config.kv_transfer_config(1 << 20))
    conn = OffloadingConnector(vc, KVConnectorRole.WORKER, kvc)
    kv = {n: torch.randn(NUM_BLOCKS, 1, BLOCK, 2 * 64) for n in LAYERS}
    conn.register_kv_caches(kv)
    w = conn.connector_worker.worker
    assert isinstance(w, HostCopyOffloadingWorker)
    assert conn.connector_worker.spec.get_worker(None) is w  # built once
    assert [h.shape for h in w.host] == [(w.num_chunks, PAGE)] * len(LAYERS)
    orig = {n: t[[2, 3]].clone() for n, t in kv.items()}
    registered = getattr(conn.connector_worker, "_kv_caches", None)  # 0.34
    assert w.submit_store(1, engine_side(GPULoadStoreSpec([2, 3], [2], [0]), registered),
                          CPULoadStoreSpec([5, 1]))
    for t in kv.values():
        t.zero_()
    assert w.submit_load(2, CPULoadStoreSpec([5, 1]),
                         engine_side(GPULoadStoreSpec([7, 8], [2], [0]), registered))
    for n, t in kv.items():
        assert torch.equal(t[[7, 8]], orig[n])
    assert [r.transfer_size for r in w.get_finished()] == [2 * PAGE * len(LAYERS)] * 2
