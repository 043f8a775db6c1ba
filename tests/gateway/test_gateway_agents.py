"""Concurrent agent loops through ``mori serve`` with simulated engines, more KV demand
than the GPU tier holds: programs are held and released, every request completes, and
``/v1/programs``, ``/v1/decisions`` and ``/metrics`` agree with what happened."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any

import httpx
import openai
import pytest
from gateway_harness import LoopThread

from mori.gateway.app import Gateway, create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig, start_simulated_backends

GPU_TOKENS = 120_000
STEPS = 4


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_gateway(lt: LoopThread, policy: str, replicas: int) -> tuple[str, Gateway]:
    settings = GatewaySettings(policy=policy, time_scale=20.0, hold_timeout_s=60)
    cfg = ServeConfig(replicas=replicas, preset="h200-qwen3-30b-a3b", cpu_ratio=0.5,
                      gpu_kv_tokens=GPU_TOKENS, settings=settings)
    adapters, handles = lt.call(start_simulated_backends(cfg))
    lt.handles.extend(handles)
    app = create_app(settings, adapters)
    url = lt.serve(app).url
    return url, app.state.gateway


def agent(url: str, model: str, pid: str, seed: int, out: dict[str, Any]) -> None:
    rng = random.Random(seed)
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    context = rng.randrange(20_000, 40_000)
    texts = []
    for step in range(STEPS):
        stream = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"step {step}"}],
            max_tokens=16, stream=True, stream_options={"include_usage": True},
            extra_body={"program_id": pid,
                        "mori": {"prompt_tokens": context, "reuse_tokens": context // 2}})
        words = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                words.append(chunk.choices[0].delta.content)
        texts.append("".join(words))
        context += 16 + rng.randrange(2_000, 6_000)
        time.sleep(rng.uniform(0.05, 0.3))  # the tool call
    r = httpx.post(f"{url}/v1/programs/{pid}/release")
    out[pid] = (texts, r.status_code)


@pytest.mark.parametrize("policy,replicas", [("mori", 1), ("mori", 2), ("thunderagent", 1)])
def test_agent_loops_are_held_released_and_all_complete(loop_thread: LoopThread, policy: str,
                                                        replicas: int) -> None:
    url, gw = start_gateway(loop_thread, policy, replicas)
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    n = 8 * replicas  # 8 x ~40k tokens per replica against 120k of GPU KV
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=agent, args=(url, model, f"agent-{i}", i, out))
               for i in range(n)]
    for t in threads:
        t.start()
    seen_held = False
    while any(t.is_alive() for t in threads):
        progs = httpx.get(url + "/v1/programs").json()["data"]
        seen_held |= any(p["status"] == "held" for p in progs)
        time.sleep(0.02)
    for t in threads:
        t.join()
    # every request completed with the engine's text, every release was accepted
    assert len(out) == n
    for texts, status in out.values():
        assert status == 200
        assert len(texts) == STEPS and all(len(t.split()) == 16 for t in texts)
    assert seen_held
    # the policy's state: all released, ledger consistent
    assert httpx.get(url + "/v1/programs").json()["data"] == []
    gw.ctl.policy.check_integrity()
    # the decision log: each program forwarded once per step, promoted before forwarded
    log = httpx.get(url + "/v1/decisions").json()["data"]
    forwards = Counter(d["program_id"] for d in log if d["kind"] == "forward")
    assert forwards == {f"agent-{i}": STEPS for i in range(n)}
    releases = Counter(d["program_id"] for d in log if d["kind"] == "release")
    assert releases == {f"agent-{i}": 1 for i in range(n)}
    demotes = [d for d in log if d["kind"] == "demote"]
    promotes = [d for d in log if d["kind"] == "promote"]
    assert demotes and len(promotes) > n  # KV demand exceeded the GPU: programs moved
    # the metrics say the same
    m = httpx.get(url + "/metrics").text
    assert metric(m, "mori_requests_total") == n * STEPS + 0  # all 200
    assert 'status="200"' in m and 'status="5' not in m
    assert metric(m, "mori_promotions_total") == len(promotes)
    assert metric(m, "mori_demotions_total") == len(demotes)
    assert metric(m, "mori_held_requests_total") >= 1
    assert metric(m, "mori_held_seconds_count") == n * STEPS
    assert metric(m, "mori_ttft_seconds_count") == n * STEPS
    assert metric(m, "mori_completion_tokens_total") == n * STEPS * 16
    assert metric(m, "mori_programs") == 0
    assert metric(m, "mori_held_queue_length") == 0
