"""End to end on a real vLLM (CPU build, tiny random-weight Llama, 2,048-token KV pool):
``mori serve`` in front of it with several agent loops whose combined context exceeds
the pool (the adapter on its own: ``test_vllm_e2e_adapter``, which runs first).

The scenario runs once, in a module-scoped fixture that returns what it observed; the
tests below it each check one claim against that record.

Selected with ``-m e2e``; skipped with ``MORI_SKIP_VLLM=1``.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .agent_turns import text, turn_of
from .conftest import VLLMServer, free_port, http_ok, stop_group

pytestmark = pytest.mark.e2e

class Gateway:
    def __init__(self, vllm: VLLMServer, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        backend = f"vllm={vllm.url},kv_events={vllm.kv_events}"
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mori", "serve", "--backend", backend,
                 "--port", str(self.port)], stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True)

    def wait(self, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        while not http_ok(self.url + "/v1/programs"):
            if self.proc.poll() is not None:
                pytest.fail(f"mori serve exited with status {self.proc.returncode}:\n"
                            f"{self.log.read_text(errors='replace')[-3000:]}", pytrace=False)
            if time.monotonic() - t0 > timeout:
                pytest.fail(f"mori serve did not answer within {timeout} s:\n"
                            f"{self.log.read_text(errors='replace')[-3000:]}", pytrace=False)
            time.sleep(0.3)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            body = r.read().decode()
            return json.loads(body) if r.headers.get_content_type() == "application/json" \
                else body

    def post(self, path: str) -> int:
        req = urllib.request.Request(self.url + path, data=b"{}", method="POST",
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    def stop(self) -> None:
        stop_group(self.proc, grace_s=10)


def metric(text_: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus text exposition."""
    total = 0.0
    for line in text_.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)", line)
        if m:
            total += float(m.group(2))
    return total


AGENTS = 8
TURNS = 4
AGENT_IDS = {f"agent-{i}" for i in range(AGENTS)}
SLOW_TOOL_S = 0.6
"""The tool time of the odd agents. The even ones' tools take at most 20 ms: far shorter
than ``mori``'s price of a drop here (a recompute of their context at ``mori serve``'s
default 20,000 tokens/s, times the 2-3 programs the pool holds: about 0.1 s), so they
stay resident; the odd ones are away well past it, so programs waiting for the pool
drop them. Both kinds of turns come every run: resident ones, and ones after a
demotion (``test_resident_turns_hit_more_than_turns_after_demotion``)."""


def tool_s(seed: int, rng: random.Random) -> float:
    """How long agent ``seed``'s tool runs this turn (see ``SLOW_TOOL_S``)."""
    if seed % 2:
        return SLOW_TOOL_S + rng.uniform(0.0, 0.1)
    return rng.uniform(0.0, 0.02)


def agent_loop(client: Any, pid: str, seed: int, results: list[dict[str, Any]],
               errors: list[str], histories: dict[str, list[dict[str, str]]]) -> None:
    """One agent: a system prompt, then turns of (tool result -> model call -> tool time)."""
    rng = random.Random(seed)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"Agent {pid}. " + text(250, rng)}]
    histories[pid] = messages
    try:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"tool output {turn}: " +
                             text(90, rng)})
            results.append(turn_of(client, pid, turn, messages))
            time.sleep(tool_s(seed, rng))  # the tool runs
    except Exception as e:  # reported by the test thread
        errors.append(f"{pid}: {type(e).__name__}: {e}")


def engine_metrics(vllm: VLLMServer) -> str:
    with urllib.request.urlopen(vllm.url + "/metrics", timeout=30) as r:
        return r.read().decode()


def hit_rate(rows: list[dict[str, Any]]) -> float:
    return sum(r["cached"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))


@dataclass(frozen=True)
class GatewayRun:
    """What ``mori serve`` and the engine showed around the agents' run, in the order taken:
    engine metrics before; the agents' turns; programs, decisions and residency after them;
    one more turn of a resident program alone; gateway and engine metrics; the releases."""

    kv_tokens: int
    engine_before: str  # vLLM /metrics before any agent turn
    turns: list[dict[str, Any]]  # the agents' turns, as each client saw them
    errors: list[str]  # agent loops that raised
    programs: list[dict[str, Any]]  # /v1/programs after the agents' turns
    decisions: list[dict[str, Any]]  # /v1/decisions after the agents' turns
    residency: dict[str, Any]  # /v1/residency's (only) backend after the agents' turns
    final_program: str | None  # the resident program that sent one more turn alone
    final: dict[str, Any] | None  # that turn, as its client saw it
    final_error: str | None  # why that turn did not happen or failed
    metrics: str  # the gateway's /metrics after the final turn
    engine_after: str  # vLLM /metrics after the final turn
    released: dict[str, int]  # HTTP status of POST /v1/programs/{id}/release, per agent
    programs_after_release: list[dict[str, Any]]

    @property
    def results(self) -> list[dict[str, Any]]:
        """Every request the clients made: the agents' turns, then the final one."""
        return self.turns + ([self.final] if self.final is not None else [])

    @property
    def last(self) -> dict[str, int]:
        """Each agent's prompt tokens at its last turn."""
        return {r["program"]: r["prompt_tokens"] for r in self.turns if r["turn"] == TURNS - 1}

    @property
    def engine_gpu(self) -> dict[str, int]:
        return dict(self.residency.get("engine_gpu_tokens", {}))

    @property
    def policy_gpu(self) -> list[str]:
        return list(self.residency.get("policy_gpu", []))

    @property
    def resident(self) -> set[str]:
        """Programs on the GPU both per the policy and per the engine's KV events."""
        return set(self.policy_gpu) & set(self.engine_gpu)

    def engine_delta(self, name: str) -> float:
        return metric(self.engine_after, name) - metric(self.engine_before, name)

    def split_turns(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The agents' turns after the first: (those whose program stayed resident since its
        previous turn, those after a demotion), from the decision log's forwards."""
        log = self.decisions
        forwards: dict[str, list[int]] = {}
        for i, d in enumerate(log):
            if d["kind"] == "forward":
                forwards.setdefault(d["program_id"], []).append(i)
        stayed = []
        for r in self.turns:
            idx = forwards.get(r["program"], [])
            assert len(idx) > r["turn"], \
                f"{r['program']}: {len(idx)} forward decisions logged, turn {r['turn']} done"
            if r["turn"] == 0:
                continue
            lo, hi = idx[r["turn"] - 1], idx[r["turn"]]
            if not any(d["kind"] == "demote" and d["program_id"] == r["program"]
                       for d in log[lo:hi]):
                stayed.append(r)
        moved = [r for r in self.turns if r["turn"] > 0 and r not in stayed]
        return stayed, moved

    def summary(self) -> str:
        stayed, moved = self.split_turns()
        final = self.final or {"cached": 0, "prompt_tokens": 0}
        return (
            f"vLLM e2e: {len(self.results)} requests from {AGENTS} agents, last contexts "
            f"{sum(self.last.values())} tokens against a {self.kv_tokens}-token pool; "
            f"held {metric(self.metrics, 'mori_held_requests_total'):.0f}, promotions "
            f"{metric(self.metrics, 'mori_promotions_total'):.0f}, demotions "
            f"{metric(self.metrics, 'mori_demotions_total'):.0f}; prompt tokens "
            f"{sum(r['prompt_tokens'] for r in self.results)}, cached "
            f"{sum(r['cached'] for r in self.results)} (engine prefix hits "
            f"+{self.engine_delta('vllm:prefix_cache_hits_total'):.0f}); "
            f"{sum(r['cached'] > 0 for r in stayed)} of {len(stayed)} turns of resident "
            f"programs hit, a resident program's turn alone cached {final['cached']} of "
            f"{final['prompt_tokens']} tokens, hit rate {hit_rate(stayed):.2f} vs "
            f"{hit_rate(moved):.2f} after a demotion ({len(moved)} turns); at the end, engine "
            f"GPU residency {self.engine_gpu}, policy GPU tier {self.policy_gpu} "
            f"({len(self.resident)} of {len(self.policy_gpu)} resident on the engine)")


def run_gateway(openai: Any, vllm: VLLMServer, log: Path) -> GatewayRun:
    gw = Gateway(vllm, log)
    try:
        gw.wait()
        before = engine_metrics(vllm)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", timeout=300,
                               max_retries=0)
        turns: list[dict[str, Any]] = []
        errors: list[str] = []
        histories: dict[str, list[dict[str, str]]] = {}
        threads = [threading.Thread(target=agent_loop,
                                    args=(client, f"agent-{i}", i, turns, errors, histories))
                   for i in range(AGENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        errors += [f"{t.name}: still running after 600 s" for t in threads if t.is_alive()]

        programs = gw.get("/v1/programs")["data"]
        decisions = gw.get("/v1/decisions")["data"]
        residency = gw.get("/v1/residency")["data"][0]

        # a program resident on the GPU per policy and KV events sends its next turn alone
        resident = set(residency.get("policy_gpu", [])) & set(
            residency.get("engine_gpu_tokens", {}))
        final_program = sorted(resident)[0] if resident else None
        final: dict[str, Any] | None = None
        final_error: str | None = None
        if final_program is None:
            final_error = f"no program resident per both policy and KV events: {residency}"
        else:
            try:
                history = histories[final_program]
                history.append({"role": "user", "content": "tool output final: done"})
                final = turn_of(client, final_program, TURNS, history)
            except Exception as e:  # reported by the test that needs it
                final_error = f"{final_program}: {type(e).__name__}: {e}"

        metrics = gw.get("/metrics")
        after = engine_metrics(vllm)
        released = {pid: gw.post(f"/v1/programs/{pid}/release") for pid in histories}
        programs_after = gw.get("/v1/programs")["data"]
    finally:
        gw.stop()
    return GatewayRun(vllm.kv_tokens, before, turns, errors, programs, decisions, residency,
                      final_program, final, final_error, metrics, after, released,
                      programs_after)


@pytest.fixture(scope="module")
def gateway_run(vllm_server: VLLMServer,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayRun]:
    openai = pytest.importorskip(
        "openai", reason="the gateway scenario drives its agents with the openai client, "
                         "which is not installed")
    run = run_gateway(openai, vllm_server, tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        print("\n" + run.summary(), file=sys.stderr)
    except (AssertionError, KeyError, TypeError, ValueError) as e:  # the tests say what
        print(f"\nvLLM e2e: no summary ({type(e).__name__}: {e})", file=sys.stderr)
    yield run


def test_agent_loops_raise_no_errors(gateway_run: GatewayRun) -> None:
    assert not gateway_run.errors, f"agent loops failed: {gateway_run.errors}"


def test_every_agent_turn_completed(gateway_run: GatewayRun) -> None:
    assert len(gateway_run.turns) == AGENTS * TURNS, \
        f"{len(gateway_run.turns)} of {AGENTS * TURNS} agent turns completed " \
        f"(errors: {gateway_run.errors})"


def test_every_reply_has_engine_text(gateway_run: GatewayRun) -> None:
    empty = [(r["program"], r["turn"]) for r in gateway_run.turns if not r["text"]]
    assert not empty, f"turns answered with no text: {empty}"


def test_last_contexts_exceed_the_kv_pool(gateway_run: GatewayRun) -> None:
    last = gateway_run.last
    assert sum(last.values()) > gateway_run.kv_tokens, \
        f"the agents' last contexts total {sum(last.values())} tokens, not more than the " \
        f"{gateway_run.kv_tokens}-token pool: {last}"


def test_gateway_lists_every_agent(gateway_run: GatewayRun) -> None:
    listed = {row["program_id"] for row in gateway_run.programs}
    assert listed == AGENT_IDS, f"/v1/programs lists {sorted(listed)}, not the {AGENTS} agents"


def test_programs_are_acting_between_turns(gateway_run: GatewayRun) -> None:
    rows = [row for row in gateway_run.programs if row["status"] != "acting"]
    assert not rows, f"programs not 'acting' after their last turn: {rows}"


def test_programs_count_every_step(gateway_run: GatewayRun) -> None:
    rows = [row for row in gateway_run.programs if row["steps"] != TURNS]
    assert not rows, f"programs whose steps are not {TURNS}: {rows}"


def test_program_context_is_the_engines_count(gateway_run: GatewayRun) -> None:
    # the policy's context is the engine's own count (usage), not an estimate
    last = gateway_run.last
    for row in gateway_run.programs:
        assert row["program_id"] in last, \
            f"{row['program_id']}: no last turn seen by its client ({row})"
        assert row["context_tokens"] >= last[row["program_id"]], \
            f"{row['program_id']}: context_tokens {row['context_tokens']} below the " \
            f"engine's {last[row['program_id']]} prompt tokens at its last turn ({row})"


def test_pool_pressure_demoted_a_program(gateway_run: GatewayRun) -> None:
    demoted = {d["program_id"] for d in gateway_run.decisions if d["kind"] == "demote"}
    assert demoted, "the pool was exceeded but no program was demoted"


def test_residency_report_has_no_error(gateway_run: GatewayRun) -> None:
    assert "error" not in gateway_run.residency, \
        f"/v1/residency reports an error: {gateway_run.residency}"


def test_engine_residency_is_the_agents(gateway_run: GatewayRun) -> None:
    # the blocks the KV events attribute are the agents'
    extra = set(gateway_run.engine_gpu) - AGENT_IDS
    assert not extra, \
        f"KV events attribute GPU blocks to non-agents {sorted(extra)}: {gateway_run.residency}"


def test_engine_residency_fits_the_pool(gateway_run: GatewayRun) -> None:
    total = sum(gateway_run.engine_gpu.values())
    assert 0 < total <= gateway_run.kv_tokens, \
        f"KV events put {total} tokens on the GPU, not within 1..{gateway_run.kv_tokens}: " \
        f"{gateway_run.residency}"


def test_policy_gpu_programs_are_resident_on_the_engine(gateway_run: GatewayRun) -> None:
    # (some of) the programs the policy holds on the GPU have blocks there. Not all: vLLM
    # evicts by LRU, not by MORI's tiers, so a resident program idle in a tool call can lose
    # its blocks to a demoted program's more recent ones (see docs/vllm-sglang.md).
    assert gateway_run.resident, \
        f"no program of the policy's GPU tier holds blocks per the KV events: " \
        f"{gateway_run.residency}"


def test_resident_turns_hit_more_than_turns_after_demotion(gateway_run: GatewayRun) -> None:
    # vLLM evicts by LRU, not by MORI's tiers (it takes no per-program eviction order): a
    # resident program idle in a tool call can lose blocks to a demoted one whose blocks are
    # more recent, so under load not every resident turn hits; on the whole they hit more
    # than turns after a demotion.
    stayed, moved = gateway_run.split_turns()
    # the workload makes both kinds (SLOW_TOOL_S): fewer is a failure, not a skip
    assert len(stayed) >= 3 and len(moved) >= 3, \
        f"{len(stayed)} turns of programs that stayed resident and {len(moved)} after a " \
        f"demotion: the comparison needs at least 3 of each"
    assert hit_rate(stayed) > hit_rate(moved), \
        f"hit rate {hit_rate(stayed):.3f} of {len(stayed)} resident turns is not above " \
        f"{hit_rate(moved):.3f} of {len(moved)} turns after a demotion: {stayed}, {moved}"


def test_resident_programs_next_turn_hits_the_prefix_cache(gateway_run: GatewayRun) -> None:
    # a program resident on the GPU per policy and KV events, sending its next turn alone:
    # the engine's prefix cache must serve its history
    assert gateway_run.final is not None, \
        f"the resident program's turn did not run: {gateway_run.final_error}"
    assert gateway_run.final["cached"] > 0, \
        f"{gateway_run.final_program}'s turn alone had no cached tokens: " \
        f"{gateway_run.final} (residency {gateway_run.residency})"


def test_requests_were_held(gateway_run: GatewayRun) -> None:
    # how many depends on timing (a request waits when it arrives while the programs the GPU
    # tier holds are all mid-answer)
    assert metric(gateway_run.metrics, "mori_held_requests_total") > 0, \
        f"mori_held_requests_total is 0:\n{gateway_run.metrics}"


def test_gateway_reports_the_engines_load(gateway_run: GatewayRun) -> None:
    # read from vLLM's /metrics every --load-interval (1 s by default): both states of
    # the one replica are there
    for state in ("running", "waiting"):
        assert re.search(rf'^mori_replica_engine_requests\{{replica="0",state="{state}"\}} ',
                         gateway_run.metrics, re.M), gateway_run.metrics


def test_engine_prompt_tokens_match_the_clients(gateway_run: GatewayRun) -> None:
    seen = sum(r["prompt_tokens"] for r in gateway_run.results)
    delta = gateway_run.engine_delta("vllm:prompt_tokens_total")
    assert delta == seen, f"vllm:prompt_tokens_total rose by {delta}, the clients saw {seen}"


def test_gateway_prompt_tokens_match_the_clients(gateway_run: GatewayRun) -> None:
    seen = sum(r["prompt_tokens"] for r in gateway_run.results)
    counted = metric(gateway_run.metrics, "mori_prompt_tokens_total")
    assert counted == seen, f"mori_prompt_tokens_total is {counted}, the clients saw {seen}"


def test_engine_generation_tokens_match_the_clients(gateway_run: GatewayRun) -> None:
    seen = sum(r["completion"] for r in gateway_run.results)
    delta = gateway_run.engine_delta("vllm:generation_tokens_total")
    assert delta == seen, f"vllm:generation_tokens_total rose by {delta}, the clients saw {seen}"


def test_gateway_completion_tokens_match_the_clients(gateway_run: GatewayRun) -> None:
    seen = sum(r["completion"] for r in gateway_run.results)
    counted = metric(gateway_run.metrics, "mori_completion_tokens_total")
    assert counted == seen, \
        f"mori_completion_tokens_total is {counted}, the clients saw {seen}"


def test_clients_saw_cached_tokens(gateway_run: GatewayRun) -> None:
    assert sum(r["cached"] for r in gateway_run.results) > 0, \
        "no request reported cached prompt tokens"


def test_engine_prefix_hits_cover_the_cached_tokens(gateway_run: GatewayRun) -> None:
    cached = sum(r["cached"] for r in gateway_run.results)
    delta = gateway_run.engine_delta("vllm:prefix_cache_hits_total")
    assert delta >= cached, \
        f"vllm:prefix_cache_hits_total rose by {delta}, less than the {cached} cached " \
        f"tokens the clients saw"


def test_gateway_counts_every_request(gateway_run: GatewayRun) -> None:
    counted = metric(gateway_run.metrics, "mori_requests_total")
    assert counted == AGENTS * TURNS + 1, \
        f"mori_requests_total is {counted}, not the {AGENTS * TURNS} agent turns plus the " \
        f"resident program's turn (the clients made {len(gateway_run.results)})"


def test_release_answers_200(gateway_run: GatewayRun) -> None:
    bad = {pid: s for pid, s in gateway_run.released.items() if s != 200}
    assert not bad, f"POST /v1/programs/{{id}}/release did not answer 200: {bad}"


def test_released_programs_are_gone(gateway_run: GatewayRun) -> None:
    assert gateway_run.programs_after_release == [], \
        f"/v1/programs after releasing every agent: {gateway_run.programs_after_release}"
