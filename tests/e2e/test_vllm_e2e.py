"""End to end on a real vLLM (CPU build, tiny random-weight Llama, 2,048-token KV pool):
the adapter against the engine, then ``mori serve`` in front of it with several agent
loops whose combined context exceeds the pool.

Selected with ``-m e2e``; skipped with ``MORI_SKIP_VLLM=1``.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from mori.engines.base import Capability, RequestHints
from mori.engines.vllm import VLLMAdapter

from .conftest import VLLMServer, free_port, http_ok, stop_group

pytestmark = pytest.mark.e2e

WORDS = ["the", "agent", "reads", "a", "file", "then", "runs", "the", "tests", "and", "edits", "the", "code", "until", "the", "build", "passes", "while", "another", "program", "waits", "for", "its", "tool", "call"]


def text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# -- the adapter on its own ------------------------------------------------------------------

def test_adapter_against_real_vllm(vllm_server: VLLMServer) -> None:
    async def go() -> None:
        a = VLLMAdapter(vllm_server.url, kv_events=vllm_server.kv_events)
        await a.start()
        try:
            assert await a.health()
            cap = await a.capacity()
            assert (cap.gpu_tokens, cap.page_tokens) == (vllm_server.kv_tokens, 32)
            assert a.supports(Capability.RESIDENCY) and not a.supports(Capability.PREFETCH)
            await asyncio.sleep(0.5)  # let the SUB socket join before the engine publishes
            rng = random.Random(1)
            system = "You are a coding agent. " + text(100, rng)
            before = await a.prefix_cache()
            for i, pid in enumerate(("e2e-a", "e2e-b")):
                body = {"model": "tiny", "max_tokens": 4, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": text(60, rng)}]}
                n = await a.count_prompt_tokens("/v1/chat/completions", body)
                resp = await a.forward("/v1/chat/completions", body, False,
                                       RequestHints(pid, priority=i))
                assert resp.status == 200, resp.body
                usage = json.loads(resp.body or b"")["usage"]
                assert usage["prompt_tokens"] == n
                if i == 1:  # the shared system prompt was cached by the first program
                    assert usage["prompt_tokens_details"]["cached_tokens"] > 0
            after = await a.prefix_cache()
            assert after.hits > before.hits
            deadline = time.monotonic() + 10
            while True:
                res = await a.residency()
                if {"e2e-a", "e2e-b"} <= set(res.gpu_tokens):
                    break
                assert time.monotonic() < deadline, f"no residency seen: {res}"
                await asyncio.sleep(0.2)
            assert res.gpu_tokens["e2e-a"] >= 128 and res.gpu_tokens["e2e-b"] >= 128
            load = await a.load()
            assert load.running == 0 and 0.0 <= load.kv_usage <= 1.0
        finally:
            await a.close()
    asyncio.run(go())


# -- the gateway in front of it --------------------------------------------------------------

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
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)

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
            time.sleep(rng.uniform(0.0, 0.15))  # the tool runs
    except Exception as e:  # reported by the test thread
        errors.append(f"{pid}: {type(e).__name__}: {e}")


def turn_of(client: Any, pid: str, turn: int, messages: list[dict[str, str]],
            max_tokens: int = 48) -> dict[str, Any]:
    """One model call of an agent; its reply joins ``messages``."""
    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0.0,
        extra_body={"program_id": pid})
    reply = resp.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": reply})
    details = resp.usage.prompt_tokens_details if resp.usage else None
    return {"program": pid, "turn": turn, "text": reply,
            "prompt_tokens": resp.usage.prompt_tokens if resp.usage else 0,
            "completion": resp.usage.completion_tokens if resp.usage else 0,
            "cached": (details.cached_tokens or 0) if details else 0}


def engine_metrics(vllm: VLLMServer) -> str:
    with urllib.request.urlopen(vllm.url + "/metrics", timeout=30) as r:
        return r.read().decode()


def test_gateway_agents_exceeding_the_pool(vllm_server: VLLMServer, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    gw = Gateway(vllm_server, tmp_path / "gateway.log")
    try:
        gw.wait()
        before = engine_metrics(vllm_server)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", timeout=300,
                               max_retries=0)
        results: list[dict[str, Any]] = []
        errors: list[str] = []
        histories: dict[str, list[dict[str, str]]] = {}
        threads = [threading.Thread(target=agent_loop,
                                    args=(client, f"agent-{i}", i, results, errors, histories))
                   for i in range(AGENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors
        # every request completed with text from the engine
        assert len(results) == AGENTS * TURNS
        assert all(r["text"] for r in results)
        # the agents' last contexts together exceed the engine's KV pool
        last = {r["program"]: r["prompt_tokens"] for r in results if r["turn"] == TURNS - 1}
        assert sum(last.values()) > vllm_server.kv_tokens, last

        programs = gw.get("/v1/programs")["data"]
        assert {row["program_id"] for row in programs} == {f"agent-{i}" for i in range(AGENTS)}
        for row in programs:
            assert row["status"] == "acting" and row["steps"] == TURNS, row
            # the policy's context is the engine's own count (usage), not an estimate
            assert row["context_tokens"] >= last[row["program_id"]], row

        # programs were gated and released (promoted again) along the way
        log = gw.get("/v1/decisions")["data"]
        demoted = {d["program_id"] for d in log if d["kind"] == "demote"}
        assert demoted, "the pool was exceeded but no program was demoted"

        # residency from KV events matches the programs the gateway placed on the GPU
        res = gw.get("/v1/residency")["data"][0]
        assert "error" not in res, res
        engine_gpu = res["engine_gpu_tokens"]
        # the blocks the events attribute are the agents', within the pool, and the
        # programs the policy holds on the GPU are (some of) them. Not all: vLLM evicts by
        # LRU, not by MORI's tiers, so a resident program idle in a tool call can lose
        # its blocks to a demoted program's more recent ones (see the README).
        assert set(engine_gpu) <= {f"agent-{i}" for i in range(AGENTS)}, res
        assert 0 < sum(engine_gpu.values()) <= vllm_server.kv_tokens, res
        resident = set(res["policy_gpu"]) & set(engine_gpu)
        assert resident, res

        # prefix-cache hits for programs that stayed resident between their turns
        forwards: dict[str, list[int]] = {}
        for i, d in enumerate(log):
            if d["kind"] == "forward":
                forwards.setdefault(d["program_id"], []).append(i)
        stayed = []
        for r in results:
            idx = forwards[r["program"]]
            if r["turn"] == 0:
                continue
            lo, hi = idx[r["turn"] - 1], idx[r["turn"]]
            if not any(d["kind"] == "demote" and d["program_id"] == r["program"]
                       for d in log[lo:hi]):
                stayed.append(r)
        # vLLM evicts by LRU, not by MORI's tiers (it takes no per-program eviction
        # order): a resident program idle in a tool call can lose blocks to a demoted one
        # whose blocks are more recent, so under load not every resident turn hits; on
        # the whole they hit more than turns after a demotion.
        stayed_hits = sum(r["cached"] > 0 for r in stayed)
        moved = [r for r in results if r["turn"] > 0 and r not in stayed]
        def hit_rate(rows: list[dict[str, Any]]) -> float:
            return sum(r["cached"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))
        if len(stayed) >= 3 and len(moved) >= 3:
            assert hit_rate(stayed) > hit_rate(moved), (stayed, moved)
        # a program resident on the GPU per policy and KV events, sending its next turn
        # alone: the engine's prefix cache must serve its history
        pid = sorted(resident)[0]
        history = histories[pid]
        history.append({"role": "user", "content": "tool output final: done"})
        final = turn_of(client, pid, TURNS, history)
        results.append(final)
        assert final["cached"] > 0, (final, res)

        metrics = gw.get("/metrics")
        # requests were gated: how many depends on timing (a request waits when it arrives
        # while the programs the GPU tier holds are all mid-answer)
        assert metric(metrics, "mori_gated_requests_total") > 0, metrics

        # the engine's counters and the gateway's agree with what the clients saw
        after = engine_metrics(vllm_server)
        def delta(name: str) -> float:
            return metric(after, name) - metric(before, name)
        prompt_seen = sum(r["prompt_tokens"] for r in results)
        cached_seen = sum(r["cached"] for r in results)
        assert delta("vllm:prompt_tokens_total") == prompt_seen
        assert metric(metrics, "mori_prompt_tokens_total") == prompt_seen
        assert delta("vllm:generation_tokens_total") == sum(r["completion"] for r in results)
        assert metric(metrics, "mori_completion_tokens_total") == sum(
            r["completion"] for r in results)
        assert delta("vllm:prefix_cache_hits_total") >= cached_seen > 0
        assert metric(metrics, 'mori_requests_total') == AGENTS * TURNS + 1

        print(f"\nvLLM e2e: {len(results)} requests from {AGENTS} agents, last contexts "
              f"{sum(last.values())} tokens against a {vllm_server.kv_tokens}-token pool; "
              f"gated {metric(metrics, 'mori_gated_requests_total'):.0f}, promotions "
              f"{metric(metrics, 'mori_promotions_total'):.0f}, demotions "
              f"{metric(metrics, 'mori_demotions_total'):.0f}; prompt tokens {prompt_seen}, "
              f"cached {cached_seen} (engine prefix hits +"
              f"{delta('vllm:prefix_cache_hits_total'):.0f}); {stayed_hits} of {len(stayed)} "
              f"turns of resident programs hit, a resident program's turn alone cached "
              f"{final['cached']} of {final['prompt_tokens']} tokens, hit rate {hit_rate(stayed):.2f} vs "
              f"{hit_rate(moved):.2f} after a demotion ({len(moved)} turns); at the end, engine "
              f"GPU residency {engine_gpu}, policy GPU tier {res['policy_gpu']} "
              f"({len(resident)} of {len(res['policy_gpu'])} resident on the engine)",
              file=sys.stderr)
        for pid in histories:
            assert gw.post(f"/v1/programs/{pid}/release") == 200
        assert gw.get("/v1/programs")["data"] == []
    finally:
        gw.stop()
