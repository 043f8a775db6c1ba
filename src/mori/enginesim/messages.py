"""The simulated engine's Anthropic Messages API: the answer's body, its stream, and
Anthropic's error shape.

The message: ``{"id": "msg_...", "type": "message", "role": "assistant", "model",
"content": [text block?, tool_use block?], "stop_reason": "end_turn" | "tool_use" |
"max_tokens", "stop_sequence": null, "usage"}``. Usage follows Anthropic's convention:
``input_tokens`` are the prompt tokens *not* read from cache, ``cache_read_input_tokens``
the engine's cached tokens (so the two add up to the prompt),
``cache_creation_input_tokens`` 0, ``output_tokens`` the answer's tokens.

A stream sends ``event: NAME`` / ``data: JSON`` events as the official SDK parses them:
``message_start`` with the first output token (the usage it carries needs the cache hit,
known once the KV is in place), then per content block ``content_block_start``,
``content_block_delta`` (``text_delta``; ``input_json_delta`` for a ``tool_use`` block)
and ``content_block_stop``, then ``message_delta`` (``stop_reason``, the usage) and
``message_stop``. An engine that aborts the request sends an ``error`` event.

Errors: ``{"type": "error", "error": {"type", "message"}}``, the type by status
(``ERROR_TYPES``: 400 ``invalid_request_error``, 404 ``not_found_error``, ...; a full
queue, 503, ``overloaded_error``).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from mori.enginesim.answers import Answer, Stop
from mori.enginesim.calls import Call
from mori.enginesim.streams import sse_named
from mori.protocol.errors import RequestError
from mori.sim.realtime import Track

STOP_REASONS = {Stop.END: "end_turn", Stop.TOOL: "tool_use", Stop.LENGTH: "max_tokens"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 499: "invalid_request_error",
               503: "overloaded_error", 529: "overloaded_error"}
"""Anthropic's error ``type`` for a status (others: ``api_error``)."""


def error_type(status: int, code: str | None = None) -> str:
    """The Anthropic error type of an error (a 503 that is no full queue: ``api_error``)."""
    if status == 503 and code not in (None, "overloaded"):
        return "api_error"
    return ERROR_TYPES.get(status, "api_error")


def anthropic_error_body(status: int, message: str, code: str | None = None
                         ) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(status, code), "message": message}}


def anthropic_error_response(status: int, message: str, code: str | None = None) -> Response:
    """An error answer in Anthropic's shape."""
    return Response(json.dumps(anthropic_error_body(status, message, code)),
                    status_code=status, media_type="application/json")


def anthropic_error(e: RequestError) -> Response:
    """``e`` in Anthropic's shape (its message names the field at fault)."""
    return anthropic_error_response(e.status, e.message, e.code)


def anthropic_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """An ``event: error`` in a Messages stream."""
    return sse_named("error", anthropic_error_body(status, message, code))


def messages_usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    """Anthropic's usage: input tokens not read from cache, plus the cache reads."""
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}


def _content(answer: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.text or answer.tool is None:
        blocks.append({"type": "text", "text": answer.text})
    if answer.tool is not None:
        blocks.append({"type": "tool_use", "id": "toolu_" + answer.tool.key,
                       "name": answer.tool.name, "input": answer.tool.input})
    return blocks


def message_body(call: Call, track: Track, rid: str) -> dict[str, Any]:
    """The answer to a finished non-streaming request."""
    answer = call.answer
    return {"id": rid, "type": "message", "role": "assistant", "model": call.model,
            "content": _content(answer), "stop_reason": STOP_REASONS[answer.stop],
            "stop_sequence": None,
            "usage": messages_usage(call.prompt, answer.tokens, track.cached_tokens)}


class MessagesStream:
    """The events of a Messages stream (``mori.enginesim.streams.Render``)."""

    def __init__(self, call: Call, track: Track, rid: str) -> None:
        self.call = call
        self.track = track
        self.rid = rid
        self.block = -1  # the index of the open content block (-1: none yet)
        self.open = False
        self.text_block = bool(call.answer.text) or call.answer.tool is None

    def head(self) -> bytes:
        return b""

    def _start(self) -> bytes:
        message: dict[str, Any] = {"id": self.rid, "type": "message", "role": "assistant",
                   "model": self.call.model, "content": [], "stop_reason": None,
                   "stop_sequence": None,
                   "usage": messages_usage(self.call.prompt, 1, self.track.cached_tokens)}
        return sse_named("message_start", {"type": "message_start", "message": message})

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.block += 1
        self.open = True
        return out + sse_named("content_block_start", {
            "type": "content_block_start", "index": self.block, "content_block": block})

    def _close(self) -> bytes:
        if not self.open:
            return b""
        self.open = False
        return sse_named("content_block_stop", {"type": "content_block_stop",
                                                "index": self.block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_named("content_block_delta", {"type": "content_block_delta",
                                                 "index": self.block, "delta": delta})

    def _token(self, i: int) -> bytes:
        answer = self.call.answer
        piece = answer.piece(i)
        out = b""
        if answer.is_text(i):
            if not self.text_block:
                return b""
            if i == 0:
                out = self._open({"type": "text", "text": ""})
            return out + (self._delta({"type": "text_delta", "text": piece}) if piece else b"")
        tool = answer.tool
        if tool is not None and i == answer.text_tokens:
            out = self._open({"type": "tool_use", "id": "toolu_" + tool.key,
                              "name": tool.name, "input": {}})
        if piece:
            out += self._delta({"type": "input_json_delta", "partial_json": piece})
        return out

    def tokens(self, start: int, stop: int) -> bytes:
        head = self._start() if start == 0 else b""
        return head + b"".join(self._token(i) for i in range(start, stop))

    def tail(self) -> bytes:
        answer = self.call.answer
        return b"".join((
            self._close(),
            sse_named("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": STOP_REASONS[answer.stop], "stop_sequence": None},
                "usage": messages_usage(self.call.prompt, answer.tokens,
                                        self.track.cached_tokens)}),
            sse_named("message_stop", {"type": "message_stop"})))

    def aborted(self) -> bytes:
        return anthropic_error_event(503, "the engine aborted the request", "aborted")
