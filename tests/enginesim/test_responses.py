"""The simulated engine's OpenAI Responses API (``mori.enginesim.responses``): the official
``openai`` client's ``responses.create`` (streamed and not) and ``responses.stream``, the
usage, and errors in OpenAI's shape."""

from __future__ import annotations

import math
from typing import Any

import openai

from mori.enginesim import EngineSimServer
from mori.protocol.fields import KV_READY_LINE, RESPONSES
from mori.protocol.tokens import compact_json

from .harness import MODEL, client, http, run, sse_events

TOOLS: list[Any] = [{"type": "function", "name": "read", "description": "Read a file",
                     "parameters": {"type": "object",
                                    "properties": {"path": {"type": "string"}}}}]
INPUT: list[Any] = [
    {"role": "developer", "content": "be brief"},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 40}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "abcd"}]},
    {"type": "function_call", "call_id": "call_1", "name": "read", "arguments": '{"p":1}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "y" * 20},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "ok"}]},
]


def test_responses_create() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            r = await c.responses.create(model=MODEL, instructions="sys" * 4, input=INPUT,
                                         tools=TOOLS)
            assert r.id.startswith("resp_") and r.object == "response"
            assert r.status == "completed" and r.model == MODEL
            assert r.instructions == "sys" * 4
            assert len(r.output_text.split()) == 16
            assert [o.type for o in r.output] == ["message"]
            chars = 12 + len(compact_json(TOOLS[0])) + 8 + 40 + 4 + 4 + 7 + 20 + 2
            assert r.usage is not None
            assert r.usage.input_tokens == math.ceil(chars / 4)
            assert r.usage.input_tokens_details.cached_tokens == 0
            assert r.usage.output_tokens == 16
            assert r.usage.output_tokens_details.reasoning_tokens == 0
            assert r.usage.total_tokens == r.usage.input_tokens + 16
            r = await c.responses.create(model=MODEL, input="hi", max_output_tokens=4)
            assert r.status == "incomplete" and r.incomplete_details is not None
            assert r.incomplete_details.reason == "max_output_tokens"
            assert len(r.output_text.split()) == 4

    run(go)


def test_responses_stream_events() -> None:
    async def go(srv: EngineSimServer) -> None:
        raw, events = await sse_events(srv, RESPONSES, {"model": MODEL, "input": "hi " * 40,
                                                         "stream": True})
        assert KV_READY_LINE.decode() in raw
        names = [n for n, _ in events]
        assert names == (["response.created", "response.in_progress",
                          "response.output_item.added", "response.content_part.added"]
                         + ["response.output_text.delta"] * 16
                         + ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done", "response.completed"])
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert all(d["type"] == n for n, d in events)
        done = events[-1][1]["response"]
        assert done["status"] == "completed" and done["usage"]["input_tokens"] == 30
        async with client(srv) as c:
            stream = await c.responses.create(model=MODEL, input="hello", stream=True)
            text, final = "", None
            async for ev in stream:
                if ev.type == "response.output_text.delta":
                    text += ev.delta
                elif ev.type == "response.completed":
                    final = ev.response
            assert final is not None and final.output_text == text
            assert len(text.split()) == 16
            async with c.responses.stream(model=MODEL, input="hello") as s:
                async for _ in s:
                    pass
                response = await s.get_final_response()
            assert len(response.output_text.split()) == 16
            assert response.usage is not None and response.usage.output_tokens == 16

    run(go)


def test_cached_tokens_of_a_growing_conversation() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            items: list[Any] = [{"role": "user", "content": "a" * 8000}]
            first = await c.responses.create(model=MODEL, input=items,
                                              extra_headers={"X-Program-Id": "codex-1"})
            items += [{"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "b" * 40}]
            second = await c.responses.create(model=MODEL, input=items,
                                               extra_headers={"X-Program-Id": "codex-1"})
            assert first.usage is not None and second.usage is not None
            assert first.usage.input_tokens_details.cached_tokens == 0
            assert second.usage.input_tokens_details.cached_tokens > 1500

    run(go)


def test_bad_requests_get_openai_errors() -> None:
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"model": MODEL, "input": 5}, 400, "input"),
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": [{"role": "user", "content": 3}]}, 400,
         "input[0].content"),
        ({"model": MODEL, "input": [{"type": "function_call", "name": "f", "arguments": {}}]},
         400, "input[0].arguments"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"model": MODEL, "input": "hi", "instructions": ["x"]}, 400, "instructions"),
        ({"model": "gpt-nope", "input": "hi"}, 404, "model"),
    ]

    async def go(srv: EngineSimServer) -> None:
        for body, status, param in cases:
            got, answer = await http(srv, "POST", RESPONSES, body)
            assert (got, answer["error"]["param"]) == (status, param), body
            assert answer["error"]["type"] == "invalid_request_error"
        async with client(srv) as c:
            try:
                await c.responses.create(model="gpt-nope", input="hi")
            except openai.NotFoundError as e:
                assert e.code == "model_not_found"
            else:
                raise AssertionError("no error")

    run(go)


def test_an_engine_abort_ends_the_stream_with_response_failed() -> None:
    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            stream = await c.responses.create(model=MODEL, input="hi", stream=True,
                                              extra_body={"mori": {"prompt_tokens": 50_000}})
            kinds = []
            async for ev in stream:
                kinds.append(ev.type)
                if ev.type == "response.in_progress":
                    srv.engine.abort_all()
                if ev.type == "response.failed":
                    assert ev.response.status == "failed" and ev.response.error is not None
                    assert ev.response.error.code == "server_error"
            assert kinds == ["response.created", "response.in_progress", "response.failed"]

    run(go, time_scale=1.0)
