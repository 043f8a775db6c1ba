"""The simulated engine's Anthropic Messages API (``mori.enginesim.messages``): the
official ``anthropic`` client, streamed and not, ``count_tokens``, usage in Anthropic's
convention (input not read from cache + cache reads = the prompt), and errors in
Anthropic's shape."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import anthropic
import pytest

from mori.enginesim import EngineSimServer
from mori.protocol.fields import COUNT_TOKENS, KV_READY_LINE, MESSAGES
from mori.protocol.tokens import compact_json, text_prompt_tokens

from .harness import MODEL, anthropic_client, http, run, sse_events

SYSTEM = "You are a careful assistant. " * 10
TOOLS: list[Any] = [{"name": "Read", "description": "Read a file",
                     "input_schema": {"type": "object",
                                      "properties": {"path": {"type": "string"}}}}]


def test_messages_non_streaming_and_count_tokens() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with anthropic_client(srv) as c:
            msgs: list[Any] = [{"role": "user", "content": "x" * 401}]
            # (the client streams 32000-token requests; 8192 is its non-streaming most)
            m = await c.messages.create(model=MODEL, max_tokens=8192, system=SYSTEM,
                                        messages=msgs, tools=TOOLS)
            assert m.id.startswith("msg_") and m.type == "message"
            assert m.role == "assistant" and m.model == MODEL
            assert m.stop_reason == "end_turn" and m.stop_sequence is None
            assert len(m.content) == 1 and m.content[0].type == "text"
            assert len(m.content[0].text.split()) == 16  # the placeholder, not 32000
            chars = len(SYSTEM) + 401 + len(compact_json(TOOLS[0]))
            assert m.usage.input_tokens == math.ceil(chars / 4)
            assert m.usage.cache_read_input_tokens == 0
            assert m.usage.cache_creation_input_tokens == 0
            assert m.usage.output_tokens == 16
            counted = await c.messages.count_tokens(model=MODEL, system=SYSTEM,
                                                    messages=msgs, tools=TOOLS)
            assert counted.input_tokens == m.usage.input_tokens
            # a limit under the placeholder's length cuts it
            m = await c.messages.create(model=MODEL, max_tokens=5, messages=msgs)
            assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
            assert len(m.content[0].text.split()) == 5

    run(go)


def test_messages_stream_events_and_helper() -> None:
    async def go(srv: EngineSimServer) -> None:
        body = {"model": MODEL, "max_tokens": 32000, "stream": True,
                "messages": [{"role": "user", "content": "hello " * 50}]}
        raw, events = await sse_events(srv, MESSAGES + "?beta=true", body)
        assert KV_READY_LINE.decode() in raw
        names = [n for n, _ in events]
        assert names == (["message_start", "content_block_start"]
                         + ["content_block_delta"] * 16
                         + ["content_block_stop", "message_delta", "message_stop"])
        assert all(d["type"] == n for n, d in events)
        start = events[0][1]["message"]
        assert start["id"].startswith("msg_") and start["content"] == []
        assert start["stop_reason"] is None
        assert start["usage"]["input_tokens"] == 75
        assert events[1][1]["content_block"] == {"type": "text", "text": ""}
        delta = events[-2][1]
        assert delta["delta"]["stop_reason"] == "end_turn"
        assert delta["usage"]["output_tokens"] == 16
        async with anthropic_client(srv) as c:
            async with c.messages.stream(model=MODEL, max_tokens=32000,
                                         messages=body["messages"]) as s:
                text = "".join([t async for t in s.text_stream])
                final = await s.get_final_message()
            assert final.content[0].type == "text" and final.content[0].text == text
            assert len(text.split()) == 16
            assert final.stop_reason == "end_turn" and final.usage.output_tokens == 16
            # stream=True through the client, on the beta path (?beta=true)
            stream = await c.beta.messages.create(model=MODEL, max_tokens=3, stream=True,
                                                  messages=body["messages"])
            kinds = [e.type async for e in stream]
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert kinds.count("content_block_delta") == 3

    run(go)


def test_usage_reports_cache_reads_of_a_growing_conversation() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with anthropic_client(srv, {"X-Program-Id": "agent-1"}) as c:
            msgs: list[Any] = [{"role": "user", "content": "a" * 8000}]
            first = await c.messages.create(model=MODEL, max_tokens=8192, messages=msgs)
            assert first.usage.cache_read_input_tokens == 0
            assert first.usage.input_tokens == 2000
            msgs += [{"role": "assistant", "content": first.content[0].text},
                     {"role": "user", "content": "b" * 400}]
            second = await c.messages.create(model=MODEL, max_tokens=8192, messages=msgs)
            prompt = text_prompt_tokens(MESSAGES, {"messages": msgs})
            cached = second.usage.cache_read_input_tokens or 0
            assert cached > 1500  # the first request's context, page-granular
            assert second.usage.input_tokens + cached == prompt
            async with c.messages.stream(model=MODEL, max_tokens=100, messages=msgs) as s:
                final = await s.get_final_message()
            assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) \
                == prompt

    run(go)


HI: list[Any] = [{"role": "user", "content": "hi"}]
BAD: list[tuple[dict[str, Any], int, str, str]] = [
    ({"model": MODEL, "messages": HI}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": HI}, 400, "invalid_request_error",
     "max_tokens"),
    ({"model": MODEL, "max_tokens": 10, "messages": {"role": "user"}}, 400,
     "invalid_request_error", "messages"),
    ({"model": MODEL, "max_tokens": 10, "messages": [
        *HI, {"role": "assistant", "content": "ok"}, {"role": "user", "content": 7}]}, 400,
     "invalid_request_error", "'messages[2].content'"),
    ({"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "name": "x", "input": "not an object"}]}]}, 400,
     "invalid_request_error", "'messages[0].content[0].input'"),
    ({"model": MODEL, "max_tokens": 10, "messages": [{"role": 7, "content": "x"}]}, 400,
     "invalid_request_error", "'messages[0].role'"),
    ({"model": MODEL, "max_tokens": 10, "system": 3, "messages": HI}, 400,
     "invalid_request_error", "'system'"),
    ({"max_tokens": 10, "messages": HI}, 400, "invalid_request_error", "model"),
    ({"model": "claude-nope", "max_tokens": 10, "messages": HI}, 404, "not_found_error",
     "claude-nope"),
]


def test_bad_requests_get_anthropic_errors() -> None:
    async def go(srv: EngineSimServer) -> None:
        for body, status, kind, names in BAD:
            got, answer = await http(srv, "POST", MESSAGES, body)
            assert got == status, body
            assert answer["type"] == "error" and set(answer["error"]) == {"type", "message"}
            assert answer["error"]["type"] == kind
            assert names in answer["error"]["message"], answer
            if names != "max_tokens":  # count_tokens (no max_tokens) reads the rest alike
                got, answer = await http(srv, "POST", COUNT_TOKENS, body)
                assert got == status and answer["error"]["type"] == kind
        got, answer = await http(srv, "POST", MESSAGES, raw=b"{not json")
        assert got == 400 and answer["error"]["type"] == "invalid_request_error"
        async with anthropic_client(srv) as c:
            with pytest.raises(anthropic.NotFoundError) as e:
                await c.messages.create(model="claude-nope", max_tokens=5, messages=HI)
            assert e.value.status_code == 404

    run(go)


def test_a_full_queue_is_overloaded() -> None:
    async def go(srv: EngineSimServer) -> None:
        msgs: list[Any] = [{"role": "user", "content": "hi"}]
        big = {"mori": {"prompt_tokens": 60_000}}
        async with anthropic_client(srv) as c:
            # the first runs, holding most of the GPU pool; the second waits
            s1 = await c.messages.create(model=MODEL, max_tokens=10, messages=msgs,
                                         stream=True, extra_body=big)
            s2 = await c.messages.create(model=MODEL, max_tokens=10, messages=msgs,
                                         stream=True, extra_body=big)
            with pytest.raises(anthropic.APIStatusError) as e:
                await c.messages.create(model=MODEL, max_tokens=10, messages=msgs)
            assert e.value.status_code == 503
            assert isinstance(e.value.body, dict)
            assert e.value.body["error"]["type"] == "overloaded_error"
            await s1.close()
            await s2.close()

    run(go, max_queue=1, gpu_kv_tokens=65_536, time_scale=1.0)


def test_an_engine_abort_ends_the_stream_with_an_error_event() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with anthropic_client(srv) as c:
            stream = await c.messages.create(model=MODEL, max_tokens=10, messages=HI,
                                             stream=True,
                                             extra_body={"mori": {"prompt_tokens": 50_000}})
            await asyncio.sleep(0.05)
            srv.engine.abort_all()
            with pytest.raises(anthropic.APIStatusError) as e:
                async for _ in stream:
                    pass
            assert isinstance(e.value.body, dict)
            assert e.value.body["error"]["type"] == "api_error"

    run(go, time_scale=1.0)
