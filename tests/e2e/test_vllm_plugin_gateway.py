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

Then one agent is released and the gateway is restarted: the new one reads the plug-in's
residency (its KV events start empty) and knows every other agent again, on the engine,
before any request; the released one it does not take back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .agent_turns import text, turn_of
from .conftest import BLOCK_SIZE, NUM_BLOCKS, free_port, http_ok, stop_group
from .plugin_engine import Engine, ask_plugin, start_engine

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
    released: str = ""
    held: dict[str, Any] = field(default_factory=dict)  # the plug-in's residency then
    after_restart: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    restart_log: str = ""


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


def _serve(backend: str, log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    gw = f"http://127.0.0.1:{port}"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--backend", backend,
                                 "--port", str(port)], stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    t0 = time.monotonic()
    while not http_ok(gw + "/v1/programs"):
        if proc.poll() is not None or time.monotonic() - t0 > 60:
            stop_group(proc, grace_s=10)
            pytest.fail(f"mori serve did not start:\n{log.read_text()[-3000:]}",
                        pytrace=False)
        time.sleep(0.3)
    return gw, proc


def _program(gw: str, pid: str) -> dict[str, Any] | None:
    try:
        return dict(_get(f"{gw}/v1/programs/{pid}"))
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def _run(engine: Engine, kv_events: str, log: Path) -> PluginRun:
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency")
    backend = (f"vllm={engine.url},kv_events={kv_events},labels={engine.labels},"
               f"kv_tokens={POLICY_TOKENS}")
    gw, proc = _serve(backend, log)
    released = "agent-0"
    try:
        client = openai.OpenAI(base_url=gw + "/v1", api_key="none", timeout=300,
                               max_retries=0)
        turns, errors, checkpoints = _agents_in_rounds(client, gw)
        decisions = _get(gw + "/v1/decisions")["data"]
        req = urllib.request.Request(f"{gw}/v1/programs/{released}/release", b"",
                                     method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
    finally:
        stop_group(proc, grace_s=10)
    assert engine.labels is not None
    run = PluginRun(turns, errors, checkpoints, decisions, log.read_text(errors="replace"),
                    released, ask_plugin(engine.labels, [("residency", {})])["residency"])
    restart_log = log.with_name("gateway-restarted.log")
    gw, proc = _serve(backend, restart_log)
    try:
        run.after_restart = {f"agent-{i}": _program(gw, f"agent-{i}") for i in range(AGENTS)}
    finally:
        stop_group(proc, grace_s=10)
    run.restart_log = restart_log.read_text(errors="replace")
    return run


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


def test_a_restarted_gateway_finds_the_agents_on_the_engine(plugin_run: PluginRun) -> None:
    """The new gateway's KV events start empty: what it knows comes from the plug-in,
    which held the KV of every agent it knows again, and of no other."""
    held, after = plugin_run.held, plugin_run.after_restart
    assert plugin_run.released in held["inactive"], held  # the release reached the engine
    on_engine = (set(held["gpu"]) | set(held["cpu"])) - set(held["inactive"])
    known = {pid for pid, p in after.items() if p is not None}
    assert known == on_engine & set(after), (held, after, plugin_run.restart_log[-3000:])
    assert known, f"the engine held no agent's KV at the restart: {held}"
    assert all(after[pid]["replica"] in (0, None) for pid in known), after
    assert any(after[pid]["tier"] == "gpu" for pid in known), after
    assert f"restored {len(on_engine & set(after))} program(s)" in plugin_run.restart_log
