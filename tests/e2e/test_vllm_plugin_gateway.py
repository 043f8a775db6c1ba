"""``mori serve`` in front of a real vLLM with MORI's plug-in: the strict residency checks.

Agents take turns in rounds (every agent's turn k, concurrently, then a check point, then
turn k+1), through the gateway with ``labels=`` (typed eviction) on an engine whose pool
holds a few of them. The policy's GPU tier is sized below the engine's usable pool by
what the running requests' answers may add (``kv_tokens=``), so busy-labelled KV always
fits. Then, with the plug-in:

- at every check point, every program the policy holds on the GPU holds its blocks on
  the engine's GPU (residency from the engine's KV events), all of its last prompt's
  full blocks;
- a program that stayed GPU-resident between two turns finds its whole previous prompt
  cached (every full block of it).

Without the plug-in (plain LRU) neither can be promised: the earlier end-to-end test
had to weaken both checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .agent_turns import text, turn_of
from .conftest import BLOCK_SIZE, NUM_BLOCKS, free_port, http_ok, stop_group
from .plugin_engine import Engine, start_engine

pytestmark = pytest.mark.e2e

AGENTS = 4
ROUNDS = 5
USABLE_BLOCKS = 63  # 64 less vLLM's null block
ANSWER_BLOCKS = 2  # 48 answer tokens span at most 2 new blocks per running request
POLICY_TOKENS = (USABLE_BLOCKS - AGENTS * ANSWER_BLOCKS) * BLOCK_SIZE


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@dataclass
class Checkpoint:
    round: int
    policy_gpu: list[str]
    engine_gpu: dict[str, int]
    last_prompt: dict[str, int]  # each agent's prompt tokens in this round


@dataclass
class PluginRun:
    turns: list[dict[str, Any]]
    errors: list[str]
    checkpoints: list[Checkpoint]
    decisions: list[dict[str, Any]]
    gateway_log: str


def _agents_in_rounds(client: Any, gw: str) -> tuple[list[dict[str, Any]], list[str],
                                                       list[Checkpoint]]:
    import random

    rngs = {f"agent-{i}": random.Random(i) for i in range(AGENTS)}
    histories = {pid: [{"role": "system", "content": f"Agent {pid}. " + text(150, rng)}]
                 for pid, rng in rngs.items()}
    turns: list[dict[str, Any]] = []
    errors: list[str] = []
    checkpoints = []
    for k in range(ROUNDS):
        done: list[dict[str, Any]] = []

        def one(pid: str, k: int = k, done: list[dict[str, Any]] = done) -> None:
            try:
                histories[pid].append({"role": "user", "content": f"tool output {k}: "
                                       + text(70, rngs[pid])})
                done.append(turn_of(client, pid, k, histories[pid]))
            except Exception as e:  # reported by the test that needs it
                errors.append(f"{pid} round {k}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=one, args=(pid,)) for pid in histories]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        turns += done
        time.sleep(1.0)  # the engine's KV events of the last steps arrive
        res = _get(gw + "/v1/residency")["data"][0]
        checkpoints.append(Checkpoint(k, list(res.get("policy_gpu", [])),
                                      dict(res.get("engine_gpu_tokens", {})),
                                      {r["program"]: r["prompt_tokens"] for r in done}))
    return turns, errors, checkpoints


def _run(engine: Engine, kv_events: str, log: Path) -> PluginRun:
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
    port = free_port()
    gw = f"http://127.0.0.1:{port}"
    backend = (f"vllm={engine.url},kv_events={kv_events},labels={engine.labels},"
               f"kv_tokens={POLICY_TOKENS}")
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--backend", backend,
                                 "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        while not http_ok(gw + "/v1/programs"):
            if proc.poll() is not None or time.monotonic() - t0 > 60:
                pytest.fail(f"mori serve did not start:\n{log.read_text()[-3000:]}",
                            pytrace=False)
            time.sleep(0.3)
        client = openai.OpenAI(base_url=gw + "/v1", api_key="none", timeout=300,
                               max_retries=0)
        turns, errors, checkpoints = _agents_in_rounds(client, gw)
        decisions = _get(gw + "/v1/decisions")["data"]
    finally:
        stop_group(proc, grace_s=10)
    return PluginRun(turns, errors, checkpoints, decisions, log.read_text(errors="replace"))


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PluginRun]:
    import os

    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    tmp = tmp_path_factory.mktemp("plugin-gateway")
    engine, proc = start_engine(tmp, plugin=True, num_blocks=NUM_BLOCKS)
    try:
        run = _run(engine, engine.kv_events, tmp / "gateway.log")
    finally:
        stop_group(proc)
    print(f"plug-in gateway run: {len(run.turns)} turns, checkpoints "
          f"{[(c.policy_gpu, c.engine_gpu) for c in run.checkpoints]}", file=sys.stderr)
    yield run


def full_blocks(tokens: int) -> int:
    return tokens // BLOCK_SIZE * BLOCK_SIZE


def test_the_gateway_found_the_plugin(plugin_run: PluginRun) -> None:
    assert "eviction is plain LRU" not in plugin_run.gateway_log, plugin_run.gateway_log[-3000:]


def test_every_turn_completed(plugin_run: PluginRun) -> None:
    assert not plugin_run.errors, plugin_run.errors
    assert len(plugin_run.turns) == AGENTS * ROUNDS


def test_the_pool_was_under_pressure(plugin_run: PluginRun) -> None:
    assert any(d["kind"] == "demote" for d in plugin_run.decisions), \
        "no program was demoted: the agents' contexts did not exceed the policy's GPU tier"


def test_gpu_programs_hold_their_blocks_at_every_check_point(plugin_run: PluginRun) -> None:
    short = []
    for c in plugin_run.checkpoints:
        assert c.policy_gpu, f"round {c.round}: the policy holds no program on the GPU"
        for pid in c.policy_gpu:
            need = full_blocks(c.last_prompt.get(pid, 0))
            if c.engine_gpu.get(pid, 0) < need:
                short.append((c.round, pid, c.engine_gpu.get(pid, 0), need))
    assert not short, f"(round, program, engine GPU tokens, full blocks of its prompt): {short}"


def test_resident_programs_next_turn_hits_its_whole_previous_prompt(
        plugin_run: PluginRun) -> None:
    log = plugin_run.decisions
    forwards: dict[str, list[int]] = {}
    for i, d in enumerate(log):
        if d["kind"] == "forward":
            forwards.setdefault(d["program_id"], []).append(i)
    by = {(r["program"], r["turn"]): r for r in plugin_run.turns}
    checked, misses = 0, []
    for (pid, k), r in by.items():
        if k == 0:
            continue
        lo, hi = forwards[pid][k - 1], forwards[pid][k]
        if any(d["kind"] == "demote" and d["program_id"] == pid for d in log[lo:hi]):
            continue  # demoted in between: not resident
        checked += 1
        need = full_blocks(by[(pid, k - 1)]["prompt_tokens"])
        if r["cached"] < need:
            misses.append((pid, k, r["cached"], need))
    assert checked >= 3, f"only {checked} turns stayed resident: nothing much to check"
    assert not misses, f"(program, turn, cached, previous prompt's full blocks): {misses}"
