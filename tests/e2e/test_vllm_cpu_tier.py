"""MORI's CPU tier on the real engine: vLLM's offloading connector, evicting in MORI's order.

Two fresh engines with the same GPU pool (64 blocks of 32 tokens) and the same host tier
(65 chunks of one block: ``MORI_VLLM_CPU_GIB`` = 1 MiB + one chunk, larger than the pool,
so that the plug-in keeps MORI's full order there rather than a mirror-only tier's; the
CPU build's copy worker,
``mori.vllm_plugin.host_tier``): one with MORI's plug-in (its scheduler binds the tier's
``MoriCachePolicy`` to the labels), one without (vLLM's ``lru`` policy over the same tier).

1. A, B and C each send a prompt of about 12 blocks; every full block is written through
   to the host tier (33 chunks).
2. On the plug-in engine the label channel labels A idle (MORI demoted it to the CPU
   tier), B busy and C inactive.
3. D sends a prompt of about 50 blocks. The GPU must give up about 20 cached blocks (the
   plug-in's GPU order: C, the inactive, then A, the idle; LRU: A, then B), and the host
   tier must give up about 18 chunks to hold D's (MORI's order: inactive C, then busy B,
   keeping idle A; LRU: the oldest, A, then B).
4. A and C are asked again: on each engine the one that engine should have kept first
   (asking allocates blocks and writes chunks too, so it may evict): A then C with the
   plug-in, C then A without.

With the plug-in, A's next turn is served from the host tier (cached tokens > 0, the
connector's hit and load counters rise) and C, the most recent of the three but
inactive, is gone from both tiers. Without it, A (the oldest) is gone from both.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .conftest import BLOCK_SIZE, ENGINE_RELEASES
from .plugin_engine import (
    Engine,
    ask,
    metric,
    three_then_pressure,
    with_and_without_plugin,
)

pytestmark = pytest.mark.e2e

NUM_BLOCKS = 64
CPU_CHUNKS = 65  # one more than the pool: not a mirror-only tier
CHUNK_BYTES = 2 * 2 * 1 * 64 * 2 * BLOCK_SIZE  # layers x (K, V) x KV heads x head dim x bf16
CPU_GIB = CPU_CHUNKS * CHUNK_BYTES / (1 << 30)  # exact in binary: 1 MiB + a chunk
PROGRAM_BLOCKS = 12  # A, B and C each
PRESSURE_BLOCKS = 50  # D
HITS = "vllm:external_prefix_cache_hits_total"
LOADS = "vllm:kv_offload_load_bytes_total"


@dataclass(frozen=True)
class Outcome:
    prompt_tokens: dict[str, int]
    first: dict[str, int]
    cached: dict[str, int]  # when asked again after D
    cpu_hits: int  # external (host-tier) prefix hits of A's second request, in tokens
    load_bytes: float  # bytes loaded from the host tier for it
    stored_bytes: float  # bytes written to the host tier in the whole run
    handshake: dict[str, Any] | None


def _scenario(engine: Engine) -> Outcome:
    url = engine.url
    run = three_then_pressure(engine, {"A": "idle", "B": "busy", "C": "inactive"},
                              PROGRAM_BLOCKS, PRESSURE_BLOCKS)
    cached: dict[str, int] = {}
    for p in ("AC" if engine.labels is not None else "CA"):
        if p == "A":
            hits0, loads0 = metric(url, HITS), metric(url, LOADS)
        cached[p] = ask(url, f"prog-{p}", run.prompts[p])
        if p == "A":
            hits1, loads1 = metric(url, HITS), metric(url, LOADS)
    return Outcome(run.prompt_tokens, run.first, cached, int(hits1 - hits0),
                   loads1 - loads0, metric(url, "vllm:kv_offload_store_bytes_total"),
                   run.handshake)


@pytest.fixture(scope="module", params=ENGINE_RELEASES)
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, Outcome]]:
    """The scenario on each supported vLLM release (vLLM 0.33 died on the first store to
    the host tier before the plug-in took its ``insert`` call)."""
    release: str = request.param
    out = with_and_without_plugin(tmp_path_factory.mktemp("cpu-tier"), _scenario,
                                  num_blocks=NUM_BLOCKS, cpu_gib=CPU_GIB,
                                  name=f"cpu-tier-{release}", release=release)
    print(f"CPU tier, vLLM {release}:",
          {k: (v.cached, v.cpu_hits, v.load_bytes) for k, v in out.items()}, file=sys.stderr)
    yield out


def test_the_handshake_reports_the_tiers_size(outcomes: dict[str, Outcome]) -> None:
    hello = outcomes["plugin"].handshake
    assert hello is not None and hello["cpu_tier_tokens"] == CPU_CHUNKS * BLOCK_SIZE, hello


def test_every_engine_writes_through_to_its_host_tier(outcomes: dict[str, Outcome]) -> None:
    for name, o in outcomes.items():
        assert all(v == 0 for v in o.first.values()), (name, o.first)
        assert o.stored_bytes >= 3 * (PROGRAM_BLOCKS - 1) * CHUNK_BYTES, (name, o)


def test_a_program_demoted_to_the_cpu_tier_is_served_from_it(
        outcomes: dict[str, Outcome]) -> None:
    o = outcomes["plugin"]
    # all but the partial last block, most of it from the host tier
    assert o.cached["A"] >= o.prompt_tokens["A"] - BLOCK_SIZE, o
    assert o.cpu_hits >= o.cached["A"] // 2, o
    assert o.load_bytes >= (o.cpu_hits // BLOCK_SIZE) * CHUNK_BYTES > 0, o


def test_the_tier_evicts_the_inactive_before_the_idle(outcomes: dict[str, Outcome]) -> None:
    o = outcomes["plugin"]
    # C is the most recent of the three, so LRU would have kept it; labelled inactive, it
    # left the host tier (and the GPU) first
    assert o.cached["C"] <= BLOCK_SIZE, o


def test_vllms_lru_tier_loses_the_oldest_whatever_its_label(
        outcomes: dict[str, Outcome]) -> None:
    plain, typed = outcomes["plain"], outcomes["plugin"]
    assert plain.cached["A"] <= BLOCK_SIZE, plain
    assert plain.cpu_hits <= BLOCK_SIZE, plain
    assert plain.cached["C"] >= plain.prompt_tokens["C"] - BLOCK_SIZE, plain  # kept: newest
    assert typed.cached["A"] > plain.cached["A"], (typed, plain)
