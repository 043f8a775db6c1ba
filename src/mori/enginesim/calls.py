"""Reading a request to the simulated engine, whatever its API, into a ``Call``.

The prompt size is the ``mori`` field's ``prompt_tokens`` if the body has it, else the
text rule of ``mori.protocol.tokens`` (strict: the text is validated either way); the
reusable prefix is ``mori.reuse_tokens`` if given (else the engine decides,
``RealtimeReplica.submit``). The program is the ``X-Program-Id`` header (percent-encoded
UTF-8: ``mori.protocol.fields.encode_program_id``), else the body's ``program_id``, else
none (a one-shot program). The answer: ``mori.enginesim.answers``.

Per API: ``model`` must be the served model when given (404 otherwise) and is required on
Messages; the output limit is ``max_completion_tokens`` / ``max_tokens`` (chat),
``max_tokens`` (completions; required on Messages) or ``max_output_tokens``
(Responses), a positive integer when given; chat and completions take only ``n`` = 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mori.enginesim.answers import Answer, Api, answer_for
from mori.protocol.errors import RequestError, clip
from mori.protocol.fields import (
    CHAT,
    COMPLETIONS,
    MAX_PROGRAM_ID_BYTES_LIMIT,
    MESSAGES,
    PROGRAM_ID_HEADER,
    RESPONSES,
    check_program_id,
    decode_program_id,
    program_id_field,
    synthetic_sizes,
)
from mori.protocol.tokens import text_prompt_tokens
from mori.sim.script import Script

PATHS = {Api.CHAT: CHAT, Api.COMPLETIONS: COMPLETIONS, Api.MESSAGES: MESSAGES,
         Api.RESPONSES: RESPONSES}
_LIMIT_KEYS = {Api.CHAT: ("max_completion_tokens", "max_tokens"),
               Api.COMPLETIONS: ("max_tokens",), Api.MESSAGES: ("max_tokens",),
               Api.RESPONSES: ("max_output_tokens",)}


@dataclass(frozen=True, slots=True)
class Call:
    """One parsed request: what to submit to the engine, and what to answer.

    ``echo``: the body's fields a Responses answer repeats (``instructions``, ``tools``,
    ...); empty for the other APIs."""

    api: Api
    model: str
    program_id: str | None
    prompt: int
    reuse: int | None
    answer: Answer
    stream: bool
    include_usage: bool = False
    echo: Mapping[str, Any] | None = None

    @property
    def chat(self) -> bool:
        return self.api is Api.CHAT


def check_body(body: Any) -> dict[str, Any]:
    """``body`` if it is a JSON object, else ``RequestError`` (400)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


def check_model(body: Mapping[str, Any], model: str, required: bool) -> None:
    """404 for another model than ``model``; 400 for none when ``required``."""
    asked = body.get("model")
    if asked is None and required:
        raise RequestError(400, "model: field required", "model")
    if asked is not None and asked != model:
        raise RequestError(404, f"The model `{clip(str(asked))}` does not exist.", "model",
                           "model_not_found")


def output_limit(api: Api, body: Mapping[str, Any]) -> int | None:
    """The body's output limit for ``api`` (None: not given), validated."""
    keys = _LIMIT_KEYS[api]
    value: Any = next((body[k] for k in keys if body.get(k) is not None), None)
    param = keys[-1]
    if value is None:
        if api is Api.MESSAGES:
            raise RequestError(400, "max_tokens: field required", param)
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(400, f"{param} must be a positive integer", param)
    return value


def program_of(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The request's program: the header (gateway ids allowed), else ``program_id``."""
    header = headers.get(PROGRAM_ID_HEADER.lower())
    limit = MAX_PROGRAM_ID_BYTES_LIMIT
    if header:
        return check_program_id(decode_program_id(header), limit, reserved_ok=True)
    return program_id_field(body.get("program_id"), limit, reserved_ok=True)


def prompt_sizes(path: str, body: Mapping[str, Any]) -> tuple[int, int | None]:
    """``(prompt, reuse)``: the synthetic sizes if given, else the text rule's prompt (the
    text is validated either way)."""
    text_prompt = text_prompt_tokens(path, body)
    synthetic_prompt, reuse = synthetic_sizes(body)
    prompt = max(1, synthetic_prompt) if synthetic_prompt is not None else text_prompt
    return prompt, reuse


_ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "tools",
           "tool_choice", "parallel_tool_calls", "metadata", "temperature", "top_p")


def parse_call(api: Api, body: Any, headers: Mapping[str, str], model: str,
               script: Script | None = None) -> Call:
    """Read a request to ``api`` for the engine serving ``model``; ``RequestError`` for
    one it refuses (400 bad input, 404 another model)."""
    body = check_body(body)
    check_model(body, model, required=api is Api.MESSAGES)
    if api in (Api.CHAT, Api.COMPLETIONS) and body.get("n", 1) not in (1, None):
        raise RequestError(400, "only n = 1 is supported", "n")
    limit = output_limit(api, body)
    prompt, reuse = prompt_sizes(PATHS[api], body)
    pid = program_of(headers, body)
    stream = body.get("stream") is True
    opts = body.get("stream_options")
    include_usage = stream and isinstance(opts, dict) and opts.get("include_usage") is True
    echo = {k: body[k] for k in _ECHOED if k in body} if api is Api.RESPONSES else None
    return Call(api, model, pid, prompt, reuse, answer_for(api, body, script, limit), stream,
                include_usage, echo)
