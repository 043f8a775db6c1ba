"""The simulated engine served over HTTP in real time (``mori.enginesim``): its OpenAI API
(the official client, streaming or not, errors in OpenAI's shape), its timing against
the cost model, its metrics and health. Timing assertions are loose (the machine is
shared and noisy); the model's own simulated times are checked exactly.
"""

from __future__ import annotations

import math
import time

import aiohttp
import openai
import pytest

from mori.core.costmodel import CostModel, get_preset, prefill_attn_ctx
from mori.engines.http import metric_sum, parse_prometheus
from mori.enginesim import EngineSimServer
from mori.protocol.tokens import prompt_tokens

from .harness import MODEL, PRESET, client, http, run, synthetic

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



# -- metrics and health ---------------------------------------------------------------------

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
