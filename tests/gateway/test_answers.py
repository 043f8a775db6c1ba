"""Reading answers as they pass: usage, cached tokens and tool calls in each API's stream
and whole body, whatever the chunking."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from mori.gateway.answers import (
    ChatWatcher,
    MessagesWatcher,
    ResponsesWatcher,
    read_answer,
    watcher_for,
)
from mori.protocol.apis import API_BY_PATH
from mori.protocol.fields import CHAT, KV_READY_LINE, MESSAGES, RESPONSES


def sse(events: list[tuple[str | None, dict[str, Any]]]) -> bytes:
    out = b""
    for name, data in events:
        if name is not None:
            out += f"event: {name}\n".encode()
        out += b"data: " + json.dumps(data).encode() + b"\n\n"
    return out


MESSAGES_STREAM = KV_READY_LINE + b"\n\n" + sse([
    ("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [],
        "usage": {"input_tokens": 20, "cache_read_input_tokens": 900,
                  "cache_creation_input_tokens": 80, "output_tokens": 1}}}),
    ("content_block_start", {"type": "content_block_start", "index": 0,
                             "content_block": {"type": "text", "text": ""}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 0,
                             "delta": {"type": "text_delta", "text": "Let me look."}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    ("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}}),
    ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta": {
        "type": "input_json_delta", "partial_json": "{\"command\": \"ls\"}"}}),
    ("content_block_stop", {"type": "content_block_stop", "index": 1}),
    ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                       "usage": {"output_tokens": 31}}),
    ("message_stop", {"type": "message_stop"}),
])

RESPONSES_STREAM = sse([
    ("response.created", {"type": "response.created", "response": {"id": "r", "usage": None}}),
    ("response.output_item.added", {"type": "response.output_item.added", "item": {
        "type": "message", "role": "assistant", "content": []}}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "hi"}),
    ("response.output_text.delta", {"type": "response.output_text.delta", "delta": "!"}),
    ("response.output_item.added", {"type": "response.output_item.added", "item": {
        "type": "function_call", "name": "shell", "call_id": "c1", "arguments": ""}}),
    ("response.function_call_arguments.delta", {
        "type": "response.function_call_arguments.delta", "delta": "{}"}),
    ("response.completed", {"type": "response.completed", "response": {
        "id": "r", "usage": {"input_tokens": 1000, "output_tokens": 12, "total_tokens": 1012,
                             "input_tokens_details": {"cached_tokens": 768}}}}),
])

CHAT_STREAM = sse([
    (None, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "a"}}]}),
    (None, {"choices": [{"index": 0, "delta": {"tool_calls": [{
        "index": 0, "id": "call_1", "type": "function",
        "function": {"name": "Read", "arguments": ""}}]}}]}),
    (None, {"choices": [{"index": 0, "delta": {"tool_calls": [{
        "index": 0, "function": {"arguments": "{}"}}]}}]}),
    (None, {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
    (None, {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9,
                                     "prompt_tokens_details": {"cached_tokens": 32}}}),
]) + b"data: [DONE]\n\n"


def feed_in_pieces(w: Any, data: bytes, cuts: list[int]) -> None:
    last = 0
    for c in sorted(set(cuts)):
        w.feed(data[last:c])
        last = c
    w.feed(data[last:])


@given(st.lists(st.integers(0, len(MESSAGES_STREAM)), max_size=12))
def test_messages_stream(cuts: list[int]) -> None:
    w = MessagesWatcher()
    feed_in_pieces(w, MESSAGES_STREAM, cuts)
    a = w.answer
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (1000, 900, 31)
    assert a.tool_names == ["Bash"] and w.kv_ready and w.output_tokens() == 31


@given(st.lists(st.integers(0, len(RESPONSES_STREAM)), max_size=12))
def test_responses_stream(cuts: list[int]) -> None:
    w = ResponsesWatcher()
    feed_in_pieces(w, RESPONSES_STREAM, cuts)
    a = w.answer
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (1000, 768, 12)
    assert a.tool_names == ["shell"] and not w.kv_ready


@given(st.lists(st.integers(0, len(CHAT_STREAM)), max_size=12))
def test_chat_stream(cuts: list[int]) -> None:
    w = ChatWatcher()
    feed_in_pieces(w, CHAT_STREAM, cuts)
    a = w.answer
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (50, 32, 9)
    assert a.tool_names == ["Read"] and w.done


def test_streams_without_usage_count_content_events() -> None:
    w = watcher_for(API_BY_PATH[MESSAGES])
    w.feed(sse([("content_block_delta", {"type": "content_block_delta",
                                         "delta": {"type": "text_delta", "text": "x"}})] * 3))
    assert w.output_tokens() == 3 and w.answer.prompt_tokens is None
    r = watcher_for(API_BY_PATH[RESPONSES])
    r.feed(sse([("response.output_text.delta", {"type": "response.output_text.delta",
                                                "delta": "x"})] * 2))
    assert r.output_tokens() == 2


def test_whole_answers() -> None:
    msg = {"id": "msg", "type": "message", "role": "assistant", "stop_reason": "tool_use",
           "content": [{"type": "text", "text": "ok"},
                       {"type": "tool_use", "id": "t", "name": "Task", "input": {}},
                       {"type": "tool_use", "id": "u", "name": "Bash", "input": {}}],
           "usage": {"input_tokens": 5, "cache_read_input_tokens": 95, "output_tokens": 7}}
    a = read_answer(API_BY_PATH[MESSAGES], json.dumps(msg).encode())
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens) == (100, 95, 7)
    assert a.tool_names == ["Task", "Bash"]
    resp = {"output": [{"type": "reasoning", "summary": []},
                       {"type": "function_call", "name": "shell", "arguments": "{}"}],
            "usage": {"input_tokens": 10, "output_tokens": 2,
                      "input_tokens_details": {"cached_tokens": 0}}}
    a = read_answer(API_BY_PATH[RESPONSES], json.dumps(resp).encode())
    assert (a.prompt_tokens, a.cached_tokens, a.completion_tokens, a.tool_names) == (
        10, 0, 2, ["shell"])
    chat = {"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "Edit", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    a = read_answer(API_BY_PATH[CHAT], json.dumps(chat).encode())
    assert (a.prompt_tokens, a.completion_tokens, a.tool_names) == (3, 4, ["Edit"])
    plain = {"choices": [{"message": {"content": "x"}}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    assert read_answer(API_BY_PATH[CHAT], json.dumps(plain).encode()).completion_tokens == 4
    for junk in (b"", b"not json", b"[1,2]", b'{"usage": "x"}', b'{"content": 5}'):
        for path in (CHAT, MESSAGES, RESPONSES):
            a = read_answer(API_BY_PATH[path], junk)
            assert a.prompt_tokens is None and a.tool_names == []


def padded(stream: bytes, n: int = 100_000) -> bytes:
    """``stream`` with every JSON event made a long line (a ``pad`` field of ``n`` bytes)."""
    return stream.replace(b'data: {"', b'data: {"pad": "' + b"z" * n + b'", "')


def test_long_lines_in_pieces_are_read_as_whole_ones() -> None:
    """A line held over many chunks is searched as it comes (markers cut between pieces
    included) and read, or only counted, as the same line in one chunk would be; what
    ``feed`` returns is the stream, in pieces."""
    for make, stream in ((MessagesWatcher, MESSAGES_STREAM),
                         (ResponsesWatcher, RESPONSES_STREAM), (ChatWatcher, CHAT_STREAM)):
        data = padded(stream)
        whole, cut = make(), make()
        assert b"".join(whole.feed(data)) == data
        out = []
        for i in range(0, len(data), 997):  # cuts fall inside the markers too
            out += cut.feed(data[i:i + 997])
        assert b"".join(out) == data
        assert cut.answer == whole.answer and cut.events == whole.events
        assert cut.ended == whole.ended and cut.kv_ready == whole.kv_ready
        assert cut.answer.tool_names and cut.answer.completion_tokens is not None
