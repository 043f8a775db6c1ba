"""The simulated engine's completions: reading a request, and writing its answer.

The engine generates exactly ``max_completion_tokens`` / ``max_tokens`` tokens (default
16), placeholder words, one word per token. The prompt size is the ``mori`` field's
``prompt_tokens`` if the body has it, else the text rule of ``mori.protocol.tokens``
(the text is validated either way); the reusable prefix is ``mori.reuse_tokens`` if
given (else the engine decides, ``RealtimeReplica.submit``). The program is the
``X-Program-Id`` header (percent-encoded UTF-8: ``mori.protocol.fields.encode_program_id``),
else the body's ``program_id``, else none (a one-shot program).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

from mori.protocol.errors import SSE_DONE, RequestError, error_body, sse_event
from mori.protocol.fields import (
    KV_READY_LINE,
    MAX_PROGRAM_ID_BYTES_LIMIT,
    PROGRAM_ID_HEADER,
    check_program_id,
    decode_program_id,
    is_chat,
    program_id_field,
    synthetic_sizes,
)
from mori.protocol.tokens import text_prompt_tokens
from mori.sim.realtime import RealtimeReplica, Track

DEFAULT_MAX_TOKENS = 16
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
          "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore",
          "magna", "aliqua")


def token_text(i: int) -> str:
    """The text of output token ``i``: one placeholder word, space-separated."""
    word = _WORDS[i % len(_WORDS)]
    return word if i == 0 else " " + word


@dataclass(frozen=True, slots=True)
class Completion:
    """One parsed completion request."""

    chat: bool
    model: str
    program_id: str | None
    prompt: int
    reuse: int | None
    output: int
    stream: bool
    include_usage: bool


def parse_completion(path: str, body: Any, headers: Mapping[str, str], model: str
                     ) -> Completion:
    """Read a completion request for the engine serving ``model``; ``RequestError`` for
    one it refuses (400 bad input, 404 another model)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    chat = is_chat(path)
    asked = body.get("model")
    if asked is not None and asked != model:
        raise RequestError(404, f"The model `{asked}` does not exist.", "model",
                           "model_not_found")
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError(400, "only n = 1 is supported", "n")
    output: Any = body.get("max_completion_tokens") if chat else None
    if output is None:
        output = body.get("max_tokens")
    if output is None:
        output = DEFAULT_MAX_TOKENS
    if isinstance(output, bool) or not isinstance(output, int) or output < 1:
        raise RequestError(400, "max_tokens must be a positive integer", "max_tokens")
    text_prompt = text_prompt_tokens(path, body)  # validates messages / prompt
    synthetic_prompt, reuse = synthetic_sizes(body)
    prompt = max(1, synthetic_prompt) if synthetic_prompt is not None else text_prompt
    # the header is percent-encoded UTF-8 (what the gateway's adapter sends); ids the
    # gateway makes up (``anon-...``) are taken, and any the gateway may be set to allow
    header = headers.get(PROGRAM_ID_HEADER.lower())
    limit = MAX_PROGRAM_ID_BYTES_LIMIT
    pid = (check_program_id(decode_program_id(header), limit, reserved_ok=True) if header
           else program_id_field(body.get("program_id"), limit, reserved_ok=True))
    stream = body.get("stream") is True
    opts = body.get("stream_options")
    include_usage = stream and isinstance(opts, dict) and opts.get("include_usage") is True
    return Completion(chat, model, pid, prompt, reuse, output, stream, include_usage)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_body(call: Completion, track: Track, rid: str, created: int) -> dict[str, Any]:
    """The answer to a finished non-streaming request."""
    text = "".join(token_text(i) for i in range(call.output))
    choice: dict[str, Any]
    if call.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": "length"}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": call.model,
            "choices": [choice], "usage": usage(call.prompt, call.output, track.cached_tokens)}


async def stream_completion(engine: RealtimeReplica, call: Completion, track: Track, rid: str,
                            created: int) -> AsyncGenerator[bytes, None]:
    """The SSE chunks of a streaming request, each sent when its token is due. Closing
    the generator early (the client went away) aborts the request."""
    obj = "chat.completion.chunk" if call.chat else "text_completion"
    min_wait = engine.config.min_emit_interval_s

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                "model": call.model, "choices": choices}
        if call.include_usage:
            data["usage"] = usage_
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    def piece(i: int, finish: str | None = None) -> dict[str, Any]:
        text = token_text(i) if i >= 0 else ""
        if call.chat:
            delta: dict[str, Any] = {"content": text} if i >= 0 else {}
            if i == 0:
                delta = {"role": "assistant", "content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    sent = 0
    kv_said = False
    try:
        while True:
            track.changed.clear()
            engine.sync()
            if track.aborted:  # by the engine (shutting down): say so, no [DONE]
                yield sse_event(error_body(503, "the engine aborted the request",
                                           code="aborted", type_="server_error"))
                return
            if not kv_said and track.kv_ready_at is not None:
                kv_said = True
                yield KV_READY_LINE + b"\n\n"
            due = engine.tokens_done(track)
            if due > sent:
                yield b"".join(chunk([piece(i)]) for i in range(sent, due))
                sent = due
            if track.finished_at is not None:
                break
            nxt = engine.next_token_time(track)
            wait = None if nxt is None else max(engine.wall_delay(nxt), min_wait)
            await engine.wait_change(track, wait)
        tail = [chunk([piece(-1, "length")])]
        if call.include_usage:
            tail.append(chunk([], usage(call.prompt, call.output, track.cached_tokens)))
        tail.append(SSE_DONE)
        yield b"".join(tail)
    finally:
        engine.abort(track)  # no-op once finished
