"""The simulated engine served over HTTP in real time (``mori.enginesim``).

Servers run in-process on a free port, time-scaled so that each test takes well under a
second of wall time. Timing assertions are loose (the machine is shared and noisy); the
model's own simulated times are checked exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import openai
import pytest

from mori.core.costmodel import CostModel, get_preset, prefill_attn_ctx
from mori.core.types import KVLabel
from mori.engines.http import metric_sum, parse_prometheus
from mori.enginesim import EngineSimConfig, EngineSimServer, start_engine_sim
from mori.protocol.tokens import prompt_tokens
from mori.sim.clock import EventLoop
from mori.sim.engine import EngineReplica, SimRequest
from mori.sim.kvcache import KVPools

PRESET = "h200-qwen3-30b-a3b"
MODEL = get_preset(PRESET).model.name
PAGE = get_preset(PRESET).page_tokens
T = TypeVar("T")


def run(fn: Callable[..., Awaitable[T]], **config: Any) -> T:
    """Run ``fn(server)`` against a fresh engine-sim (time scale 1000 unless given)."""

    async def main() -> T:
        cfg = EngineSimConfig(PRESET, **{"time_scale": 1000.0, **config})
        srv = await start_engine_sim(cfg)
        try:
            return await asyncio.wait_for(fn(srv), 15)
        finally:
            await srv.stop()

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def client(srv: EngineSimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield c
    finally:
        await c.close()


async def http(srv: EngineSimServer, method: str, path: str,
               body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(
            method, srv.url + path, json=body if raw is None else None, data=raw,
            headers={"content-type": "application/json"}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text


def synthetic(prompt: int, reuse: int | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"prompt_tokens": prompt}
    if reuse is not None:
        m["reuse_tokens"] = reuse
    return {"mori": m}


# -- the OpenAI API ------------------------------------------------------------------------

def test_openai_client_non_streaming() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            content = "x" * 401
            r = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=7)
            assert r.object == "chat.completion"
            assert r.choices[0].message.role == "assistant"
            assert len((r.choices[0].message.content or "").split()) == 7
            assert r.usage is not None
            assert r.usage.prompt_tokens == math.ceil(401 / 4)
            assert r.usage.completion_tokens == 7
            assert r.usage.total_tokens == 101 + 7
            assert r.usage.prompt_tokens_details is not None
            assert r.usage.prompt_tokens_details.cached_tokens == 0
            # max_completion_tokens wins; the default is 16
            r = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}],
                max_completion_tokens=3)
            assert len((r.choices[0].message.content or "").split()) == 3
            r = await c.chat.completions.create(model=MODEL,
                                                messages=[{"role": "user", "content": "hi"}])
            assert r.usage is not None and r.usage.completion_tokens == 16
            t = await c.completions.create(model=MODEL, prompt="y" * 40, max_tokens=5)
            assert t.object == "text_completion"
            assert len(t.choices[0].text.split()) == 5
            assert t.usage is not None and t.usage.prompt_tokens == 10
            models = await c.models.list()
            assert [m.id for m in models.data] == [MODEL]

    run(go)


def test_openai_client_streaming() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=33,
                stream=True, stream_options={"include_usage": True},
                extra_body=synthetic(2000))
            text, usage, finish = "", None, None
            async for ch in stream:
                assert ch.object == "chat.completion.chunk"
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
                if ch.usage is not None:
                    usage = ch.usage
            assert len(text.split()) == 33
            assert finish == "length"
            assert usage is not None
            assert (usage.prompt_tokens, usage.completion_tokens) == (2000, 33)
            # without include_usage, no usage chunk
            stream2 = await c.completions.create(model=MODEL, prompt="abc", max_tokens=12,
                                                 stream=True)
            pieces = [ch async for ch in stream2]
            assert all(ch.usage is None for ch in pieces)
            assert len("".join(ch.choices[0].text for ch in pieces).split()) == 12

    run(go)


def test_bad_requests_get_openai_errors() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            with pytest.raises(openai.NotFoundError) as e:
                await c.chat.completions.create(
                    model="no-such-model", messages=[{"role": "user", "content": "hi"}])
            assert e.value.code == "model_not_found"
        status, body = await http(srv, "POST", "/v1/chat/completions", raw=b"{not json")
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        status, body = await http(srv, "POST", "/v1/chat/completions", {"model": MODEL})
        assert status == 400 and body["error"]["param"] == "messages"
        status, body = await http(srv, "POST", "/v1/chat/completions",
                                  {"model": "x", "messages": []})
        assert status == 404
        assert body["error"] == {"message": body["error"]["message"], "type":
                                 "invalid_request_error", "param": "model",
                                 "code": "model_not_found"}
        status, body = await http(srv, "POST", "/v1/completions",
                                  {"prompt": "a", "max_tokens": 0})
        assert status == 400 and body["error"]["param"] == "max_tokens"
        status, body = await http(srv, "POST", "/v1/completions",
                                  {"prompt": "a", "mori": {"prompt_tokens": -1}})
        assert status == 400
        status, body = await http(srv, "POST", "/v1/completions",
                                  {"prompt": "a", "max_tokens": 200_000})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"

    run(go)


def test_prompt_counting_rule() -> None:
    chat = {"messages": [{"role": "system", "content": "abcde"},
                         {"role": "user", "content": [{"type": "text", "text": "fgh"}]}]}
    assert prompt_tokens("/v1/chat/completions", chat) == 2  # ceil(8 / 4)
    assert prompt_tokens("/v1/chat/completions", {**chat, **synthetic(9000)}) == 9000
    assert prompt_tokens("/v1/completions", {"prompt": [1, 2, 3]}) == 3
    assert prompt_tokens("/v1/completions", {"prompt": ""}) == 1


# -- timing ---------------------------------------------------------------------------------

def test_ttft_and_latency_follow_the_cost_model() -> None:
    scale, prompt, output = 10.0, 50_000, 200
    cost = CostModel(get_preset(PRESET))
    chunk = cost.preset.chunk_size
    t_prefill, done = 0.0, 0
    while done < prompt:
        n = min(chunk, prompt - done)
        t_prefill += cost.iteration_time(n, prefill_attn_ctx(n, done), 0, 0)
        done += n
    t_decode = cost.decode_run_time(1, prompt + 1, output - 1)

    async def go(srv: EngineSimServer) -> tuple[float, float]:
        async with client(srv) as c:
            t0 = time.perf_counter()
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=output,
                stream=True, extra_body=synthetic(prompt))
            first = None
            async for ch in stream:
                if first is None and ch.choices and ch.choices[0].delta.content:
                    first = time.perf_counter() - t0
            total = time.perf_counter() - t0
        assert first is not None
        # the model itself is exact: busy time = prefill + decode
        assert srv.engine.replica.stats.busy_s == pytest.approx(t_prefill + t_decode)
        return first * scale, total * scale

    ttft, latency = run(go, time_scale=scale)
    assert 2.0 < t_prefill < 5.0  # a 50k prefill on one H200 takes seconds
    assert 0.9 * t_prefill < ttft < 1.6 * t_prefill + 1.0
    assert 0.9 * (t_prefill + t_decode) < latency < 1.6 * (t_prefill + t_decode) + 1.0
    assert latency - ttft > 0.3 * t_decode


# -- KV controls ---------------------------------------------------------------------------

def test_kv_controls_change_residency() -> None:
    async def go(srv: EngineSimServer) -> None:
        status, cap = await http(srv, "GET", "/mori/v1/capacity")
        preset = get_preset(PRESET)
        assert cap == {"gpu_tokens": preset.gpu_kv_capacity_tokens,
                       "cpu_tokens": preset.gpu_kv_capacity_tokens // PAGE * PAGE,
                       "page_tokens": PAGE,
                       "kv_bytes_per_token": preset.kv_bytes_per_token_per_gpu * preset.tp}
        async with client(srv) as c:
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_body={"program_id": "p", **synthetic(5000)})
            _, res = await http(srv, "GET", "/mori/v1/residency")
            assert res["gpu_tokens"]["p"] == math.ceil(5004 / PAGE) * PAGE
            assert "p" not in res["cpu_tokens"]
            status, state = await http(srv, "POST", "/mori/v1/programs/p/offload")
            assert status == 200 and state["gpu_tokens"] == 0
            _, res = await http(srv, "GET", "/mori/v1/residency")
            assert "p" not in res["gpu_tokens"]
            assert res["cpu_tokens"]["p"] == math.ceil(5004 / PAGE) * PAGE
            # the next step extends the conversation: its prefix is reloaded from the CPU
            r = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_body={"program_id": "p", **synthetic(6000)})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            assert r.usage.prompt_tokens_details.cached_tokens == 5004 // PAGE * PAGE
            _, stats = await http(srv, "GET", "/mori/v1/stats")
            assert stats["cpu_hit_tokens"] == 5004 // PAGE * PAGE
        status, state = await http(srv, "POST", "/mori/v1/programs/p/label", {"label": "idle"})
        assert status == 200 and state["label"] == "idle"
        assert srv.engine.pools.entries["p"].label is KVLabel.IDLE
        status, _ = await http(srv, "POST", "/mori/v1/programs/p/label", {"label": "hot"})
        assert status == 400
        status, state = await http(srv, "POST", "/mori/v1/programs/p/drop")
        assert status == 200 and (state["gpu_tokens"], state["cpu_tokens"]) == (0, 0)
        _, res = await http(srv, "GET", "/mori/v1/residency")
        assert res == {"gpu_tokens": {}, "cpu_tokens": {}}
        status, err = await http(srv, "POST", "/mori/v1/programs/nobody/offload")
        assert status == 404 and err["error"]["code"] == "program_not_found"
        status, _ = await http(srv, "POST", "/mori/v1/programs/p/release")
        assert status == 200
        srv.engine.pools.check()

    run(go, cpu_ratio=1.0)


def test_small_pool_evicts_under_pressure() -> None:
    async def go(srv: EngineSimServer) -> None:
        kept = 0
        assert srv.engine.capacity()["gpu_tokens"] == 4096
        async with client(srv) as c:
            for pid in ("a", "b"):
                await c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body={"program_id": pid, **synthetic(2500)})
            _, res = await http(srv, "GET", "/mori/v1/residency")
            pages = math.ceil(2504 / PAGE)
            kept = 4096 // PAGE - pages  # b took what a had to give up (LRU, page by page)
            assert res["gpu_tokens"] == {"a": kept * PAGE, "b": pages * PAGE}
            assert res["cpu_tokens"] == {}  # no CPU tier: evicted pages are gone
            # a's next step finds only what was left of it; the rest is recomputed
            r = await c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body={"program_id": "a", **synthetic(2600)})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            assert r.usage.prompt_tokens_details.cached_tokens == kept * PAGE
            with pytest.raises(openai.BadRequestError):  # can never fit the pool
                await c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body=synthetic(5000))
        _, stats = await http(srv, "GET", "/mori/v1/stats")
        assert stats["evicted_gpu_tokens"] > 0
        assert stats["recomputed_tokens"] == 2504 - kept * PAGE
        srv.engine.pools.check()

    run(go, gpu_kv_tokens=4096)


# -- aborts ---------------------------------------------------------------------------------

async def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def test_disconnect_mid_stream_aborts_and_frees() -> None:
    async def go(srv: EngineSimServer) -> None:
        eng = srv.engine
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 100_000, "stream": True, "program_id": "p", **synthetic(3000)}
        async with aiohttp.ClientSession() as s:
            r = await s.post(srv.url + "/v1/chat/completions", json=body)
            assert r.status == 200
            seen = b""
            while seen.count(b"data: ") < 3:
                seen += await r.content.readany()
            assert eng.running == 1
            r.close()  # the client goes away
        await _wait_for(lambda: eng.counters.aborted == 1)
        eng.sync()
        assert eng.running == 0 and not eng.replica.decode
        e = eng.pools.entries["p"]
        assert not e.pinned
        assert e.gpu * PAGE < 3000 + 100_000  # the output reservation is freed
        assert e.gpu * PAGE >= 3000 // PAGE * PAGE  # what was computed stays
        eng.pools.check()
        # a non-streaming request whose client gives up is aborted as well
        body = {**body, "stream": False, "program_id": "q"}
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(srv.url + "/v1/chat/completions", json=body,
                             timeout=aiohttp.ClientTimeout(total=0.3))
        await _wait_for(lambda: eng.counters.aborted == 2)
        assert eng.running == 0 and eng.waiting == 0
        # the engine still serves
        async with client(srv) as c:
            done = await c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert done.usage is not None and done.usage.completion_tokens == 2

    run(go, time_scale=20.0)


def test_metrics_and_health() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            await c.completions.create(model=MODEL, prompt="x" * 400, max_tokens=9)
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/health") as r:
                assert r.status == 200
            async with s.get(srv.url + "/metrics") as r:
                assert r.status == 200
                samples = parse_prometheus(await r.text())
        assert metric_sum(samples, "mori_engine_generation_tokens_total") == 9
        assert metric_sum(samples, "mori_engine_prompt_tokens_total") == 100
        assert metric_sum(samples, "mori_engine_requests_running", -1) == 0
        assert metric_sum(samples, "mori_engine_requests_waiting", -1) == 0
        assert 0 < metric_sum(samples, "mori_engine_kv_usage_ratio") < 1
        assert "mori_engine_prefix_hit_tokens_total" in samples

    run(go)


# -- the model's abort, directly ------------------------------------------------------------

class _Quiet:
    def __init__(self) -> None:
        self.done: list[str] = []

    def kv_ready(self, req: SimRequest, now: float) -> None: ...
    def first_token(self, req: SimRequest, now: float) -> None: ...
    def produced(self, tokens: int, now: float) -> None: ...

    def finished(self, req: SimRequest, now: float) -> None:
        self.done.append(req.program_id)


@pytest.mark.parametrize("when", ["waiting", "prefill", "decode", "loading"])
def test_replica_abort_in_each_phase(when: str) -> None:
    cost = CostModel(get_preset(PRESET))
    loop = EventLoop()
    rec = _Quiet()
    eng = EngineReplica(0, cost, loop, KVPools(400, 400, False), rec, False)
    if when == "loading":  # x's KV sits on the CPU: its next request reloads it first
        eng.submit(SimRequest("x", 6400, 0, 1, 0.0))
        loop.run(10.0)
        eng.evict("x")
        rec.done.clear()
        t = loop.now
    else:
        t = 0.0
    blocker = SimRequest("big", 20_000, 0, 1, t) if when == "waiting" else None
    if blocker is not None:  # holds the pool so that x waits
        eng.submit(blocker)
        blocker2 = SimRequest("big2", 4_000, 0, 5, t)
        eng.submit(blocker2)
    x = SimRequest("x", 12_800, 6400 if when == "loading" else 0, 500, t)
    other = SimRequest("o", 1000, 0, 300, t)
    eng.submit(x)
    eng.submit(other)
    if when == "prefill":
        loop.run(t + 1e-3)
        assert x in eng.prefill
    elif when == "decode":
        while x.first_token_at is None:
            loop.run(loop.now + 0.01)
        assert x in eng.decode
    elif when == "loading":
        assert eng.loading == 1
    else:
        assert x in eng.waiting
    assert eng.abort(x)
    assert not eng.abort(x)
    loop.run(t + 100.0)
    assert "x" not in rec.done and "o" in rec.done
    assert eng.running == 0 and not eng.waiting
    assert not eng.pools.entries["x"].pinned if "x" in eng.pools.entries else True
    eng.pools.check()


# -- the command line -----------------------------------------------------------------------

def test_cli_serves_until_interrupted() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import argparse, sys; from mori.cli.engine_sim_cmd import add_engine_sim_parser, "
            "run_engine_sim; p = argparse.ArgumentParser(); s = p.add_subparsers(dest='c'); "
            "add_engine_sim_parser(s); sys.exit(run_engine_sim(p.parse_args(sys.argv[1:])))")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "engine-sim", "--preset", PRESET, "--port", "0",
         "--time-scale", "1000", "--gpu-kv-tokens", "65536", "--model", "m1"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]

        async def ask() -> None:
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            r = await c.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens == 3
            await c.close()
            async with aiohttp.ClientSession() as s, s.get(url + "/mori/v1/capacity") as r2:
                assert (await r2.json())["gpu_tokens"] == 65536

        asyncio.run(ask())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_ends_streams_promptly() -> None:
    async def go() -> None:
        srv = await start_engine_sim(EngineSimConfig(PRESET, time_scale=1.0))
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000,
                "stream": True}
        async with aiohttp.ClientSession() as s:
            r = await s.post(srv.url + "/v1/chat/completions", json=body)
            seen = b""
            while b"data: " not in seen:
                seen += await r.content.readany()
            t0 = time.monotonic()
            await srv.stop()
            assert time.monotonic() - t0 < 1.5
            seen += await r.content.read()
        assert b'"code": "aborted"' in seen and b"[DONE]" not in seen
        assert srv.engine.counters.aborted == 1 and srv.engine.running == 0

    asyncio.run(asyncio.wait_for(go(), 10))
