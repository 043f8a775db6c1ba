"""An OpenAI chat completion stream translated, as it comes, to the Gemini API's stream:
SSE ``data:`` events of ``GenerateContentResponse`` chunks (``?alt=sse``).

Each chat event's reasoning and text deltas become a chunk of their own at once (a
``thought`` part, a text part), so the client sees the answer as it is generated. Tool
calls come in pieces on the chat stream (their arguments a fragment at a time) and
whole in Gemini's, so they are gathered and sent in the last chunk, with the
``finishReason`` and the ``usageMetadata`` (the chat stream's usage event, which the
translated request asks for), when the chat stream ends (``[DONE]``). A chunk with no
function call ends on an empty text part, as Gemini's own last chunks do. An error event
of the engine's becomes the Gemini API's error (``errors.gemini_error_event``), and
nothing follows it.

Only ``data:`` events (and that error) are sent: comments (the simulated engine's
``: kv-ready``) are left out, since the JavaScript SDK's stream reader expects each event
to start with ``data:``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mori.protocol.gemini.errors import engine_error, gemini_error_event
from mori.protocol.gemini.response import (
    finish_reason,
    function_call,
    reasoning_of,
    usage_metadata,
)


@dataclass(slots=True)
class _Call:
    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def _event(data: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class GeminiStream:
    """Translates one chat stream (``feed`` its whole lines as they come); ``done``
    once the last chunk or an error was sent."""

    __slots__ = ("_calls", "_finish", "_usage", "_meta", "done")

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}
        self._finish: Any = None
        self._usage: Any = None
        self._meta: dict[str, str] = {}  # modelVersion, responseId
        self.done = False

    def feed(self, lines: bytes) -> bytes:
        """The Gemini events for whole SSE lines of the chat stream (b"" if none)."""
        out: list[bytes] = []
        for line in lines.split(b"\n"):
            if self.done or not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out.append(self.last())
                continue
            try:
                data = json.loads(payload)
            except (ValueError, UnicodeDecodeError):
                continue
            if not isinstance(data, dict):
                continue
            if data.get("error") is not None:
                status, message = engine_error(0, data)
                out.append(gemini_error_event(status, message))
                self.done = True
                continue
            out.extend(self._chunk(data))
        return b"".join(out)

    def _chunk(self, data: Mapping[str, Any]) -> list[bytes]:
        for src, dst in (("model", "modelVersion"), ("id", "responseId")):
            if dst not in self._meta and isinstance(data.get(src), str):
                self._meta[dst] = data[src]
        if data.get("usage") is not None:
            self._usage = data["usage"]
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, Mapping):
            return []
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return []
        out = []
        reasoning = reasoning_of(delta)
        if isinstance(reasoning, str) and reasoning:
            out.append(self._parts([{"text": reasoning, "thought": True}]))
        text = delta.get("content")
        if isinstance(text, str) and text:
            out.append(self._parts([{"text": text}]))
        calls = delta.get("tool_calls")
        for tc in calls if isinstance(calls, list) else ():
            if isinstance(tc, Mapping):
                self._gather(tc)
        return out

    def _gather(self, tc: Mapping[str, Any]) -> None:
        index = tc.get("index", 0)
        call = self._calls.setdefault(index if isinstance(index, int) else 0, _Call())
        if isinstance(tc.get("id"), str) and tc["id"]:
            call.id = tc["id"]
        fn = tc.get("function")
        if isinstance(fn, Mapping):
            if isinstance(fn.get("name"), str) and fn["name"]:
                call.name = fn["name"]
            if isinstance(fn.get("arguments"), str):
                call.arguments.append(fn["arguments"])

    def _chunk_of(self, parts: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        candidate = {"content": {"role": "model", "parts": parts}, "index": 0, **extra}
        return {"candidates": [candidate], **self._meta}

    def _parts(self, parts: list[dict[str, Any]]) -> bytes:
        return _event(self._chunk_of(parts))

    def last(self) -> bytes:
        """The last chunk (the tool calls, the finish reason, the usage); b"" once
        ``done``."""
        if self.done:
            return b""
        self.done = True
        parts = [function_call(c.id, c.name, "".join(c.arguments))
                 for _, c in sorted(self._calls.items())] or [{"text": ""}]
        out = self._chunk_of(parts, finishReason=finish_reason(self._finish))
        usage = usage_metadata(self._usage)
        if usage is not None:
            out["usageMetadata"] = usage
        return _event(out)
