"""The simulated engine's OpenAI chat completions and completions: the answer's body, and
its stream.

What is answered: ``mori.enginesim.answers`` (unscripted, exactly ``max_tokens``
placeholder words, finish ``length``; scripted chat answers finish ``stop`` or
``tool_calls``, their call in ``message.tool_calls``, streamed as ``delta.tool_calls``).
Usage reports ``prompt_tokens_details.cached_tokens``; a stream sends it in a last chunk
with ``stream_options.include_usage``, then ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

from mori.enginesim.answers import DEFAULT_MAX_TOKENS, Answer, Stop, ToolCall, token_text
from mori.enginesim.calls import Call
from mori.enginesim.streams import sse_data
from mori.protocol.errors import SSE_DONE, error_body, sse_event
from mori.sim.realtime import Track

__all__ = ["DEFAULT_MAX_TOKENS", "ChatStream", "completion_body", "token_text", "usage"]

FINISH = {Stop.END: "stop", Stop.TOOL: "tool_calls", Stop.LENGTH: "length"}


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_call(call: ToolCall) -> dict[str, Any]:
    """A chat ``tool_calls`` entry."""
    return {"id": "call_" + call.key, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _message(answer: Answer) -> dict[str, Any]:
    if answer.tool is None:
        return {"role": "assistant", "content": answer.text}
    return {"role": "assistant", "content": answer.text or None,
            "tool_calls": [tool_call(answer.tool)]}


def completion_body(call: Call, track: Track, rid: str, created: int) -> dict[str, Any]:
    """The answer to a finished non-streaming request."""
    answer = call.answer
    choice: dict[str, Any]
    if call.chat:
        choice = {"index": 0, "message": _message(answer), "logprobs": None,
                  "finish_reason": FINISH[answer.stop]}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": answer.text, "logprobs": None,
                  "finish_reason": FINISH[answer.stop]}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": call.model,
            "choices": [choice],
            "usage": usage(call.prompt, answer.tokens, track.cached_tokens)}


class ChatStream:
    """The chunks of a chat or completions stream (``mori.enginesim.streams.Render``)."""

    def __init__(self, call: Call, track: Track, rid: str, created: int) -> None:
        self.call = call
        self.track = track
        self.rid = rid
        self.created = created
        self.obj = "chat.completion.chunk" if call.chat else "text_completion"

    def _chunk(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None
               ) -> bytes:
        data: dict[str, Any] = {"id": self.rid, "object": self.obj, "created": self.created,
                                "model": self.call.model, "choices": choices}
        if self.call.include_usage:
            data["usage"] = usage_
        return sse_data(data)

    def _delta(self, i: int) -> dict[str, Any] | None:
        """Token ``i``'s chat delta; None when it adds nothing."""
        answer = self.call.answer
        piece = answer.piece(i)
        opens_call = answer.tool is not None and i == answer.text_tokens
        delta: dict[str, Any]
        if answer.is_text(i):
            delta = {"content": piece}
        elif opens_call and answer.tool is not None:
            entry = tool_call(answer.tool)
            entry["function"]["arguments"] = piece
            delta = {"tool_calls": [{"index": 0, **entry}]}
        else:
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        if i == 0:
            return {"role": "assistant", **delta}
        return delta if piece or opens_call else None

    def _piece(self, i: int) -> dict[str, Any] | None:
        if not self.call.chat:
            text = self.call.answer.piece(i)
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
        delta = self._delta(i)
        if delta is None:
            return None
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

    def head(self) -> bytes:
        return b""

    def tokens(self, start: int, stop: int) -> bytes:
        pieces = (self._piece(i) for i in range(start, stop))
        return b"".join(self._chunk([p]) for p in pieces if p is not None)

    def tail(self) -> bytes:
        answer = self.call.answer
        finish = FINISH[answer.stop]
        last: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None,
                                 "finish_reason": finish} if self.call.chat else
                                {"index": 0, "text": "", "logprobs": None,
                                 "finish_reason": finish})
        out = [self._chunk([last])]
        if self.call.include_usage:
            out.append(self._chunk([], usage(self.call.prompt, answer.tokens,
                                             self.track.cached_tokens)))
        out.append(SSE_DONE)
        return b"".join(out)

    def aborted(self) -> bytes:
        # no [DONE]: the stream did not complete
        return sse_event(error_body(503, "the engine aborted the request", code="aborted",
                                    type_="server_error"))
