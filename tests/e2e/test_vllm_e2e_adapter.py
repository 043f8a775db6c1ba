"""End to end on a real vLLM (CPU build, tiny random-weight Llama, 2,048-token KV pool):
the adapter against the engine (``mori serve`` in front of it:
``test_vllm_e2e_gateway``).

The scenario runs once, in a module-scoped fixture that returns what it observed; the
tests below it each check one claim against that record.

Selected with ``-m e2e``; skipped with ``MORI_SKIP_VLLM=1``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest

from mori.engines.base import Capability, EngineLoad, KVCapacity, RequestHints, Residency
from mori.engines.vllm import PrefixCacheCounters, VLLMAdapter

from .agent_turns import text
from .conftest import VLLMServer

pytestmark = pytest.mark.e2e

ADAPTER_PROGRAMS = ("e2e-a", "e2e-b")
RESIDENCY_WAIT_S = 10.0


@dataclass(frozen=True)
class AdapterCall:
    """One chat completion the adapter forwarded for a program."""

    program: str
    status: int
    body: bytes | None
    counted: int  # the adapter's own count of the prompt's tokens
    usage: dict[str, Any] | None  # the engine's ``usage``, when the call succeeded


@dataclass(frozen=True)
class AdapterRun:
    """What the adapter reported, in order, talking to the real engine."""

    healthy: bool
    capacity: KVCapacity
    supports_residency: bool
    supports_prefetch: bool
    prefix_before: PrefixCacheCounters
    calls: list[AdapterCall]  # one per program of ADAPTER_PROGRAMS, in that order
    prefix_after: PrefixCacheCounters
    residency: Residency  # the last report polled
    residency_seen: bool  # both programs appeared within RESIDENCY_WAIT_S
    load: EngineLoad | None  # the engine's reported load after the forwards


async def run_adapter(vllm: VLLMServer) -> AdapterRun:
    a = VLLMAdapter(vllm.url, kv_events=vllm.kv_events)
    await a.start()
    try:
        healthy = await a.health()
        capacity = await a.capacity()
        supports_residency = a.supports(Capability.RESIDENCY)
        supports_prefetch = a.supports(Capability.PREFETCH)
        await asyncio.sleep(0.5)  # let the SUB socket join before the engine publishes
        rng = random.Random(1)
        system = "You are a coding agent. " + text(100, rng)
        before = await a.prefix_cache()
        calls = []
        for i, pid in enumerate(ADAPTER_PROGRAMS):
            body = {"model": "tiny", "max_tokens": 4, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": text(60, rng)}]}
            n = await a.count_prompt_tokens("/v1/chat/completions", body)
            resp = await a.forward("/v1/chat/completions", body, False,
                                   RequestHints(pid, priority=i))
            usage = json.loads(resp.body or b"")["usage"] if resp.status == 200 else None
            calls.append(AdapterCall(pid, resp.status, resp.body, n, usage))
        after = await a.prefix_cache()
        deadline = time.monotonic() + RESIDENCY_WAIT_S
        while True:
            res = await a.residency()
            seen = set(ADAPTER_PROGRAMS) <= set(res.gpu_tokens)
            if seen or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        load = await a.load()
        return AdapterRun(healthy, capacity, supports_residency, supports_prefetch, before,
                          calls, after, res, seen, load)
    finally:
        await a.close()


@pytest.fixture(scope="module")
def adapter_run(vllm_server: VLLMServer) -> AdapterRun:
    return asyncio.run(run_adapter(vllm_server))


def usage_of(call: AdapterCall) -> dict[str, Any]:
    assert call.usage is not None, \
        f"{call.program}: the engine answered {call.status}, not 200: {call.body!r}"
    return call.usage


def test_adapter_sees_a_healthy_engine(adapter_run: AdapterRun) -> None:
    assert adapter_run.healthy, "the adapter's health() is False against a running vLLM"


def test_adapter_capacity_is_the_engines_kv_pool(adapter_run: AdapterRun,
                                                 vllm_server: VLLMServer) -> None:
    cap = adapter_run.capacity
    usable = vllm_server.kv_tokens - 32  # vLLM keeps one block aside (its null block)
    assert (cap.gpu_tokens, cap.page_tokens) == (usable, 32), \
        f"capacity {cap} is not the engine's usable {usable}-token pool in 32-token pages"


def test_adapter_reads_the_engines_load(adapter_run: AdapterRun) -> None:
    # vllm:num_requests_running and _waiting; the forwards have ended (a gauge may lag
    # by a step, so at most the programs sent)
    load = adapter_run.load
    assert load is not None
    assert 0 <= load.requests <= len(ADAPTER_PROGRAMS)


def test_adapter_supports_residency_but_not_prefetch(adapter_run: AdapterRun) -> None:
    assert adapter_run.supports_residency, "the vLLM adapter does not claim RESIDENCY"
    assert not adapter_run.supports_prefetch, "the vLLM adapter claims PREFETCH"


def test_adapter_forwards_succeed(adapter_run: AdapterRun) -> None:
    failed = [(c.program, c.status, c.body) for c in adapter_run.calls if c.status != 200]
    assert not failed, f"forwarded calls not answered 200: {failed}"


def test_adapter_prompt_count_is_the_engines(adapter_run: AdapterRun) -> None:
    for call in adapter_run.calls:
        usage = usage_of(call)
        assert usage["prompt_tokens"] == call.counted, \
            f"{call.program}: the adapter counted {call.counted} prompt tokens, " \
            f"the engine's usage says {usage['prompt_tokens']}"


def test_adapter_second_program_hits_shared_system_prompt(adapter_run: AdapterRun) -> None:
    call = adapter_run.calls[1]  # the shared system prompt was cached by the first program
    usage = usage_of(call)
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, \
        f"{call.program} shares the first program's system prompt but no token was " \
        f"cached: {usage}"


def test_adapter_prefix_cache_hits_rise(adapter_run: AdapterRun) -> None:
    before, after = adapter_run.prefix_before, adapter_run.prefix_after
    assert after.hits > before.hits, \
        f"the engine's prefix-cache hit counter did not rise: {before} -> {after}"


def test_adapter_residency_reports_both_programs(adapter_run: AdapterRun) -> None:
    assert adapter_run.residency_seen, \
        f"no residency seen for {ADAPTER_PROGRAMS} within {RESIDENCY_WAIT_S} s: " \
        f"{adapter_run.residency}"


def test_adapter_residency_covers_each_prompt(adapter_run: AdapterRun) -> None:
    gpu = adapter_run.residency.gpu_tokens
    short = {pid: gpu.get(pid, 0) for pid in ADAPTER_PROGRAMS if gpu.get(pid, 0) < 128}
    assert not short, f"programs with under 128 GPU tokens resident: {short} ({adapter_run.residency})"
