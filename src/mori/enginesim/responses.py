"""The simulated engine's OpenAI Responses API: the response object, and its stream.

The response: ``{"id": "resp_...", "object": "response", "created_at", "status":
"completed" | "incomplete", "model", "output": [...], "usage", ...}`` with the request's
``instructions``, ``tools`` and the like repeated. ``output`` holds a ``message`` item
(``output_text`` content) when the answer has text, and a ``function_call`` item
(``call_id`` ``call_...``, ``arguments`` JSON text, and the ``namespace`` of a tool
offered in a ``type: "namespace"`` tool, as Codex's ``spawn_agent``) when it calls a
tool. An answer cut at ``max_output_tokens`` is ``incomplete`` (``incomplete_details.reason``
``max_output_tokens``). Usage: ``input_tokens`` (the prompt, cached tokens included),
``input_tokens_details.cached_tokens``, ``output_tokens``,
``output_tokens_details.reasoning_tokens`` (0), ``total_tokens``.

A stream sends ``event: NAME`` / ``data: JSON`` events, each with its
``sequence_number``: ``response.created`` and ``response.in_progress`` at once; per text
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``; per call
``response.output_item.added``, ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``, ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete``). An engine that aborts the request
sends ``response.failed``. Errors before the stream come in OpenAI's shape
(``mori.protocol.errors``).
"""

from __future__ import annotations

import uuid
from typing import Any

from mori.enginesim.answers import Answer, Stop
from mori.enginesim.calls import Call
from mori.enginesim.streams import sse_named
from mori.sim.realtime import Track


def responses_usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseItems:
    """The output items of one answer, with their ids (the same in the stream and in the
    final response)."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.has_text = bool(answer.text) or answer.tool is None
        self.message_id = "msg_" + uuid.uuid4().hex
        self.call_id = "fc_" + uuid.uuid4().hex

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [_text_part(text)] if status == "completed" else []
        return {"id": self.message_id, "type": "message", "status": status,
                "role": "assistant", "content": content}

    def function_call(self, arguments: str, status: str) -> dict[str, Any]:
        tool = self.answer.tool
        assert tool is not None
        item = {"id": self.call_id, "type": "function_call", "status": status,
                "call_id": "call_" + tool.key, "name": tool.name, "arguments": arguments}
        if tool.namespace is not None:
            item["namespace"] = tool.namespace
        return item

    def final(self) -> list[dict[str, Any]]:
        out = []
        if self.has_text:
            out.append(self.message(self.answer.text, "completed"))
        if self.answer.tool is not None:
            out.append(self.function_call(self.answer.tool.arguments, "completed"))
        return out


def response_object(call: Call, rid: str, created: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    ) -> dict[str, Any]:
    """A response object (see the module doc)."""
    echo = dict(call.echo or {})
    incomplete = status == "incomplete"
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"), "model": call.model,
        "output": output, "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": False,
        "temperature": echo.get("temperature", 1.0), "text": {"format": {"type": "text"}},
        "tool_choice": echo.get("tool_choice", "auto"), "tools": echo.get("tools", []),
        "top_p": echo.get("top_p", 1.0), "truncation": "disabled", "usage": usage,
        "user": None, "metadata": echo.get("metadata", {})}


def _status(answer: Answer) -> str:
    return "incomplete" if answer.stop is Stop.LENGTH else "completed"


def response_body(call: Call, track: Track, rid: str, created: int) -> dict[str, Any]:
    """The answer to a finished non-streaming request."""
    answer = call.answer
    return response_object(call, rid, created, _status(answer), ResponseItems(answer).final(),
                           responses_usage(call.prompt, answer.tokens, track.cached_tokens))


class ResponsesStream:
    """The events of a Responses stream (``mori.enginesim.streams.Render``)."""

    def __init__(self, call: Call, track: Track, rid: str, created: int) -> None:
        self.call = call
        self.track = track
        self.rid = rid
        self.created = created
        self.items = ResponseItems(call.answer)
        self.seq = 0
        self.text = ""  # the text sent so far
        self.arguments = ""  # the call's arguments sent so far

    def _event(self, kind: str, /, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_named(kind, data)

    def _response(self, status: str, usage: dict[str, Any] | None = None,
                  output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return response_object(self.call, self.rid, self.created, status, output or [], usage)

    def head(self) -> bytes:
        return (self._event("response.created", response=self._response("in_progress"))
                + self._event("response.in_progress", response=self._response("in_progress")))

    @property
    def _call_index(self) -> int:
        return 1 if self.items.has_text else 0

    def _open_text(self) -> bytes:
        ids = {"item_id": self.items.message_id, "output_index": 0}
        return (self._event("response.output_item.added", output_index=0,
                            item=self.items.message("", "in_progress"))
                + self._event("response.content_part.added", **ids, content_index=0,
                              part=_text_part("")))

    def _close_text(self) -> bytes:
        ids = {"item_id": self.items.message_id, "output_index": 0}
        return (self._event("response.output_text.done", **ids, content_index=0,
                            text=self.text, logprobs=[])
                + self._event("response.content_part.done", **ids, content_index=0,
                              part=_text_part(self.text))
                + self._event("response.output_item.done", output_index=0,
                              item=self.items.message(self.text, "completed")))

    def _open_call(self) -> bytes:
        return self._event("response.output_item.added", output_index=self._call_index,
                           item=self.items.function_call("", "in_progress"))

    def _close_call(self) -> bytes:
        tool = self.call.answer.tool
        assert tool is not None
        index = self._call_index
        return (self._event("response.function_call_arguments.done",
                            item_id=self.items.call_id, output_index=index,
                            name=tool.name, arguments=self.arguments)
                + self._event("response.output_item.done", output_index=index,
                              item=self.items.function_call(self.arguments, "completed")))

    def _token(self, i: int) -> bytes:
        answer = self.call.answer
        piece = answer.piece(i)
        out = b""
        if answer.is_text(i):
            if not self.items.has_text:
                return b""
            if i == 0:
                out = self._open_text()
            if piece:
                self.text += piece
                out += self._event("response.output_text.delta",
                                   item_id=self.items.message_id, output_index=0,
                                   content_index=0, delta=piece, logprobs=[])
            return out
        if i == answer.text_tokens:
            out = (self._close_text() if self.items.has_text else b"") + self._open_call()
        if piece:
            self.arguments += piece
            out += self._event("response.function_call_arguments.delta",
                               item_id=self.items.call_id, output_index=self._call_index,
                               delta=piece)
        return out

    def tokens(self, start: int, stop: int) -> bytes:
        return b"".join(self._token(i) for i in range(start, stop))

    def tail(self) -> bytes:
        answer = self.call.answer
        close = self._close_call() if answer.tool is not None else self._close_text()
        status = _status(answer)
        usage = responses_usage(self.call.prompt, answer.tokens, self.track.cached_tokens)
        name = "response.completed" if status == "completed" else "response.incomplete"
        return close + self._event(name, response=self._response(status, usage,
                                                                  self.items.final()))

    def aborted(self) -> bytes:
        response = self._response("failed")
        response["error"] = {"code": "server_error",
                             "message": "the engine aborted the request"}
        return self._event("response.failed", response=response)
