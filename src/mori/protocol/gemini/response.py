"""An OpenAI chat completion translated to a Gemini ``GenerateContentResponse``.

One candidate, role ``model``: the engine's reasoning (``reasoning_content``, or
``reasoning``) as a ``thought`` part, its text as a text part, each tool call as a
``functionCall`` part with the call's id, name and arguments (an object; arguments that
are not a JSON object come as ``{"arguments": <their text>}``). ``finishReason`` from the
chat ``finish_reason`` (``FINISH``); ``usageMetadata`` from the usage:
``promptTokenCount``, ``candidatesTokenCount``, ``totalTokenCount``, and
``cachedContentTokenCount`` (the prompt's tokens read from the engine's cache,
``prompt_tokens_details.cached_tokens``) and ``thoughtsTokenCount``
(``completion_tokens_details.reasoning_tokens``) where the engine reports them. The
engine's model name is ``modelVersion``, its completion id ``responseId``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mori.protocol.gemini.errors import engine_error, gemini_error_body

FINISH = {"stop": "STOP", "tool_calls": "STOP", "function_call": "STOP",
          "length": "MAX_TOKENS", "content_filter": "SAFETY"}
"""The Gemini ``finishReason`` of a chat ``finish_reason`` (others: ``OTHER``)."""


def finish_reason(reason: Any) -> str:
    return FINISH.get(reason, "OTHER") if isinstance(reason, str) else "STOP"


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def usage_metadata(usage: Any) -> dict[str, int] | None:
    """``usageMetadata`` of a chat ``usage`` (None: no usage)."""
    if not isinstance(usage, Mapping):
        return None
    prompt = _count(usage.get("prompt_tokens")) or 0
    output = _count(usage.get("completion_tokens")) or 0
    out = {"promptTokenCount": prompt, "candidatesTokenCount": output,
           "totalTokenCount": _count(usage.get("total_tokens")) or prompt + output}
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    if cached:
        out["cachedContentTokenCount"] = cached
    details = usage.get("completion_tokens_details")
    thoughts = _count(details.get("reasoning_tokens")) if isinstance(details, Mapping) else None
    if thoughts:
        out["thoughtsTokenCount"] = thoughts
    return out


def function_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """A ``functionCall`` part of a chat tool call's id, name and arguments (JSON text)."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) and arguments else {}
    except ValueError:
        args = None
    if not isinstance(args, dict):
        args = {"arguments": arguments}
    fc: dict[str, Any] = {"name": name if isinstance(name, str) else "", "args": args}
    if isinstance(call_id, str) and call_id:
        fc["id"] = call_id
    return {"functionCall": fc}


def reasoning_of(message: Mapping[str, Any]) -> Any:
    """The engine's reasoning text in a message or delta (vLLM's and SGLang's field)."""
    r = message.get("reasoning_content")
    return r if r is not None else message.get("reasoning")


def message_parts(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The parts of a chat ``message``: its reasoning, its text, its tool calls."""
    parts: list[dict[str, Any]] = []
    reasoning = reasoning_of(message)
    if isinstance(reasoning, str) and reasoning:
        parts.append({"text": reasoning, "thought": True})
    text = message.get("content")
    if isinstance(text, str) and text:
        parts.append({"text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        fn = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(fn, Mapping):
            parts.append(function_call(call.get("id"), fn.get("name"), fn.get("arguments")))
    if not parts:
        parts.append({"text": ""})
    return parts


def from_chat(chat: Any) -> dict[str, Any]:
    """The ``GenerateContentResponse`` of a chat completion (see the module doc); a body
    with no choice gives a candidate with an empty text and ``finishReason`` ``OTHER``."""
    data = chat if isinstance(chat, Mapping) else {}
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices \
        and isinstance(choices[0], Mapping) else {}
    message = choice.get("message")
    candidate = {"content": {"role": "model",
                             "parts": message_parts(message if isinstance(message, Mapping)
                                                    else {})},
                 "finishReason": finish_reason(choice.get("finish_reason", "other")),
                 "index": 0}
    out: dict[str, Any] = {"candidates": [candidate]}
    usage = usage_metadata(data.get("usage"))
    if usage is not None:
        out["usageMetadata"] = usage
    if isinstance(data.get("model"), str):
        out["modelVersion"] = data["model"]
    if isinstance(data.get("id"), str):
        out["responseId"] = data["id"]
    return out


def translate_answer(status: int, body: bytes) -> tuple[int, bytes]:
    """A complete engine answer (a chat completion, or an error) as the Gemini API's:
    ``from_chat``'s response for a 200, the Gemini error shape for anything else (a
    200 that is no JSON object: a 502)."""
    if status == 200:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            data = None
        if isinstance(data, dict):
            return 200, json.dumps(from_chat(data), ensure_ascii=False).encode()
        status, message = 502, "the engine's answer is not a chat completion"
    else:
        status, message = engine_error(status, body)
    return status, json.dumps(gemini_error_body(status, message)).encode()
