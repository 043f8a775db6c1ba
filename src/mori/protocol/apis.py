"""The client APIs MORI serves, and what a request body says in each of them.

Five paths, one ``ApiSpec`` each (``API_BY_PATH``), and the Gemini API's methods:

- ``/v1/chat/completions`` and ``/v1/completions``: OpenAI's (any OpenAI client, SWE-agent
  and OpenHands through litellm);
- ``/v1/messages``: Anthropic's Messages API (Claude Code; it adds ``?beta=true``, which is
  ignored like any query string);
- ``/v1/messages/count_tokens``: Anthropic's token counting (no generation: not held);
- ``/v1/responses``: OpenAI's Responses API (Codex);
- ``/v1beta/models/<model>:generateContent``, ``:streamGenerateContent`` and
  ``:countTokens`` (``v1`` too): the Gemini API (Gemini CLI), the model named in the
  path (``GEMINI_APIS``, ``api_for_path``). The engine gets its chat translation
  (``mori.protocol.gemini``).

Each spec says where a body puts its output limit, whether errors come in Anthropic's
shape (``{"type": "error", "error": {"type", "message"}}``, ``anthropic_error_body``),
the Gemini API's (``{"error": {"code", "message", "status"}}``) or OpenAI's
(``mori.protocol.errors``), and how to validate the body (``check_body``: a
``RequestError`` 400 naming the field for a wrong shape, never anything else).

Two readings of a conversation serve program identity (``mori.gateway.identity``):
``conversation_head`` is the text that starts it (the system prompt and the first user
message: a subagent or a compacted conversation starts with other text),
``carries_tool_results`` whether the request answers a tool call (the turns after the
model's last answer hold tool results), and ``is_side_request`` whether it is a tool-less
one-shot that no agent program continues. ``conversation_items`` lists a conversation's turns, each marked as the model's
answer or not, for the conversation recogniser (``mori.gateway.conversations``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mori.protocol.errors import RequestError, error_body, sse_error
from mori.protocol.fields import CHAT, COMPLETIONS, COUNT_TOKENS, MESSAGES, RESPONSES
from mori.protocol.gemini import contents as gemini
from mori.protocol.gemini.errors import gemini_error_body, gemini_error_event
from mori.protocol.gemini.routes import COUNT, GENERATE, PATHS, STREAM, gemini_route


@dataclass(frozen=True, slots=True)
class ApiSpec:
    """One client API: ``name`` (metrics and docs), ``path``, ``generates`` (a model
    call: held until placed; False for token counting), ``anthropic`` (errors in
    Anthropic's shape), ``output_keys`` (the body's output limit, first found wins),
    ``gemini`` (the Gemini API: its errors' shape, its ``contents``; the engine gets the
    body's chat translation, whose output limit ``output_keys`` read), ``streams`` (the
    path itself asks for a stream: ``streamGenerateContent``)."""

    name: str
    path: str
    generates: bool
    anthropic: bool
    output_keys: tuple[str, ...]
    gemini: bool = False
    streams: bool = False


API_BY_PATH: dict[str, ApiSpec] = {s.path: s for s in (
    ApiSpec("chat", CHAT, True, False, ("max_completion_tokens", "max_tokens")),
    ApiSpec("completions", COMPLETIONS, True, False, ("max_tokens",)),
    ApiSpec("messages", MESSAGES, True, True, ("max_tokens",)),
    ApiSpec("count_tokens", COUNT_TOKENS, False, True, ()),
    ApiSpec("responses", RESPONSES, True, False, ("max_output_tokens",)),
)}
"""Every path served, with its spec (the Gemini API's, whose paths name the model, are
``GEMINI_APIS``)."""

_CHAT_LIMITS = ("max_completion_tokens", "max_tokens")
GEMINI_APIS: dict[str, ApiSpec] = {
    GENERATE: ApiSpec("gemini", PATHS[GENERATE], True, False, _CHAT_LIMITS, gemini=True),
    STREAM: ApiSpec("gemini-stream", PATHS[STREAM], True, False, _CHAT_LIMITS, gemini=True,
                    streams=True),
    COUNT: ApiSpec("gemini-count-tokens", PATHS[COUNT], False, False, (), gemini=True),
}
"""The Gemini API's methods, by name (``mori.protocol.gemini.routes``)."""


def api_for_path(path: str) -> ApiSpec | None:
    """The API a request path (no query string) is served by; None for none."""
    spec = API_BY_PATH.get(path)
    if spec is None and (route := gemini_route(path)) is not None:
        spec = GEMINI_APIS.get(route.method)
    return spec

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large",
                         422: "invalid_request_error", 429: "rate_limit_error",
                         499: "invalid_request_error", 500: "api_error", 502: "api_error",
                         503: "overloaded_error", 504: "api_error", 529: "overloaded_error"}
"""Anthropic's error ``type`` for a status (others: ``api_error``)."""


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """An error in the Messages API's shape."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


def api_error_body(spec: ApiSpec | None, status: int, message: str, code: str | None = None,
                   retry_after_s: float | None = None) -> dict[str, Any]:
    """An error body in the shape of ``spec``'s API (None: OpenAI's)."""
    if spec is not None and spec.anthropic:
        return anthropic_error_body(status, message)
    if spec is not None and spec.gemini:
        return gemini_error_body(status, message, retry_after_s)
    return error_body(status, message, None, code)


def _bad(field: str, rule: str) -> RequestError:
    return RequestError(400, f"'{field}' {rule}", field)


def _positive_int(body: Mapping[str, Any], key: str, required: bool = False) -> None:
    v = body.get(key)
    if v is None:
        if required:
            raise _bad(key, "is required (a positive integer)")
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _bad(key, "must be a positive integer")


def _chat_messages(body: Mapping[str, Any]) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty array")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string 'role'",
                               f"messages[{i}]")


def _anthropic_messages(body: Mapping[str, Any]) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty array")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        # a string role: "user" and "assistant", and Claude Code 2.1 also sends "system"
        # messages inside the conversation
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"{where} must be an object with a string 'role'", where)
        content = m.get("content")
        if not isinstance(content, (str, list)):
            raise _bad(f"{where}.content", "must be a string or an array of content blocks")
        if isinstance(content, list):
            for j, block in enumerate(content):
                if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                    raise _bad(f"{where}.content[{j}]", "must be an object with a string "
                               "'type'")
    system = body.get("system")
    if system is not None and not isinstance(system, (str, list)):
        raise _bad("system", "must be a string or an array of text blocks")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", "must be an array")


def _responses_input(body: Mapping[str, Any]) -> None:
    inp = body.get("input")
    if inp is not None and not isinstance(inp, (str, list)):
        raise _bad("input", "must be a string or an array of input items")
    if isinstance(inp, list):
        for i, item in enumerate(inp):
            if not isinstance(item, dict):
                raise _bad(f"input[{i}]", "must be an object")
    for key in ("instructions", "previous_response_id", "prompt_cache_key"):
        v = body.get(key)
        if v is not None and not isinstance(v, str):
            raise _bad(key, "must be a string")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools", "must be an array")


def check_body(spec: ApiSpec, body: Mapping[str, Any]) -> None:
    """``RequestError`` (400, naming the field) unless ``body`` has the shape ``spec``'s
    API needs: a string ``model``, its messages / prompt / input, a boolean ``stream``,
    positive output limits. (A Gemini body is checked as it is translated:
    ``mori.protocol.gemini.request``.)"""
    assert not spec.gemini, "a Gemini body is checked by its translation"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "missing required field 'model' (a string)", "model")
    if spec.path == CHAT:
        _chat_messages(body)
    elif spec.path == COMPLETIONS:
        if not isinstance(body.get("prompt"), (str, list)):
            raise _bad("prompt", "must be a string or an array")
    elif spec.anthropic:
        _anthropic_messages(body)
    else:
        _responses_input(body)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream", "must be a boolean")
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        _positive_int(body, key, required=spec.path == MESSAGES and key == "max_tokens")


def output_limit(spec: ApiSpec, body: Mapping[str, Any]) -> int | None:
    """The request's output limit, if it sets one."""
    for key in spec.output_keys:
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


# -- reading a conversation ------------------------------------------------------------------
def _text(content: Any) -> str:
    """The plain text of a message content (a string, or the ``text`` of its parts);
    markers such as ``cache_control`` are left out, so the text of a message does not
    change when a client moves them."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping):
                t = part.get("text")
                if isinstance(t, str):
                    out.append(t)
                elif part.get("type") in ("tool_result", "function_call_output"):
                    out.append(_text(part.get("content", part.get("output"))))
        return "\n".join(out)
    return ""


def conversation_head(spec: ApiSpec, body: Mapping[str, Any]) -> str:
    """The text a conversation starts with: its system prompt (``system``,
    ``instructions``, or system / developer messages before the first user message) and
    its first user message. Two requests of one growing conversation have the same head;
    a subagent's, or a conversation compacted into a summary, starts with other text."""
    if spec.gemini:
        return gemini.conversation_head(body)
    parts: list[str] = []
    if spec.anthropic:
        parts.append(_text(body.get("system")))
        items: Any = body.get("messages")
    elif spec.path == RESPONSES:
        parts.append(body["instructions"] if isinstance(body.get("instructions"), str) else "")
        items = body.get("input")
        if isinstance(items, str):
            return "\n".join((*parts, items))
    elif spec.path == CHAT:
        items = body.get("messages")
    else:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)[:4096]
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping):
            continue
        role = item.get("role")
        text = _text(item.get("content"))
        if role == "user":
            parts.append(text)
            break
        if role in ("system", "developer"):
            parts.append(text)
    return "\n".join(parts)


_ANSWER_ITEM_TYPES = frozenset(("function_call", "custom_tool_call", "reasoning",
                                "local_shell_call", "web_search_call", "file_search_call",
                                "computer_call", "image_generation_call", "mcp_call"))
"""Responses input items that the model produced (an earlier answer, sent back)."""


def conversation_items(spec: ApiSpec, body: Mapping[str, Any]
                       ) -> tuple[str, list[tuple[bool, Any]]] | None:
    """A conversation's system prompt and its turns in order, each ``(answer, item)``:
    ``answer`` True for what the model produced (an assistant message, a Responses
    ``function_call`` or ``reasoning`` item), which a client sends back as it got it.
    None where the body is no conversation (a completion's prompt)."""
    if spec.gemini:
        return gemini.conversation_items(body)
    if spec.anthropic:
        system = _text(body.get("system"))
        items: Any = body.get("messages")
    elif spec.path == RESPONSES:
        system = body["instructions"] if isinstance(body.get("instructions"), str) else ""
        items = body.get("input")
        if isinstance(items, str):
            return system, [(False, items)]
    elif spec.path == CHAT:
        system = ""
        items = body.get("messages")
    else:
        return None
    if not isinstance(items, list):
        return None
    out: list[tuple[bool, Any]] = []
    for item in items:
        if not isinstance(item, Mapping):
            out.append((False, item))
            continue
        kind = item.get("type")
        # kind may be any JSON value (an unhashable one reads as no answer's)
        answer = (item.get("role") == "assistant" and kind in (None, "message")) or (
            isinstance(kind, str) and kind in _ANSWER_ITEM_TYPES)
        out.append((answer, item))
    return system, out


# tuples, not sets: a body's values may be unhashable (a list as a role), and membership
# in a tuple compares without hashing
_TOOL_OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output",
                      "local_shell_call_output", "tool_result")
"""Responses input items that return a tool's results."""
_CALL_ITEMS = ("function_call", "custom_tool_call", "local_shell_call", "reasoning")
"""Responses input items of the model's answer that its tool results follow."""
_INPUT_ROLES = ("user", "system", "developer")


def carries_tool_results(spec: ApiSpec, body: Mapping[str, Any]) -> bool:
    """Whether the request returns tool results: its new turns, those after the model's
    last answer (an assistant message), hold any (Anthropic ``tool_result`` blocks,
    Responses ``function_call_output`` items, chat ``tool`` messages). It follows a tool
    call, whose time the gap before it was. The results need not come last: Codex puts
    its compaction prompt after the last ``function_call_output``, Claude Code a system
    reminder after a ``tool_result``. Gemini's: ``functionResponse`` parts after the last
    ``model`` turn."""
    if spec.gemini:
        return gemini.carries_tool_results(body)
    key = "input" if spec.path == RESPONSES else "messages"
    items = body.get(key) if spec.anthropic or spec.path in (CHAT, RESPONSES) else None
    if not isinstance(items, list):
        return False
    for item in reversed(items):
        if not isinstance(item, Mapping):
            continue
        role, kind = item.get("role"), item.get("type")
        if spec.path == RESPONSES:
            if kind in _TOOL_OUTPUT_ITEMS:
                return True
            if kind in _CALL_ITEMS:
                continue
        elif spec.anthropic:
            content = item.get("content")
            if role in _INPUT_ROLES and isinstance(content, list) and any(
                    isinstance(b, Mapping) and b.get("type") == "tool_result"
                    for b in content):
                return True
        elif role == "tool":
            return True
        if role in _INPUT_ROLES and kind in (None, "message"):
            continue  # a new turn of the client's
        return False  # the model's last answer: nothing after it returned a result
    return False


def is_side_request(spec: ApiSpec, body: Mapping[str, Any]) -> bool:
    """Whether the request is a side request: a model call that offers no tools and
    continues no conversation (no earlier answer in it: no assistant turn, no tool call
    or result, no ``previous_response_id``). A title, a topic or quota check, a one-shot
    summary: it can call no tool, so no tool time follows it, and nothing continues it
    under the same conversation. Completions (a bare prompt) are never side requests."""
    if spec.gemini:
        return spec.generates and gemini.is_side_request(body)
    if not spec.generates or not (spec.anthropic or spec.path in (CHAT, RESPONSES)):
        return False
    if body.get("tools") or body.get("functions") or body.get("previous_response_id"):
        return False
    items = body.get("input" if spec.path == RESPONSES else "messages")
    if isinstance(items, str):
        return True
    if not isinstance(items, list):
        return False
    for item in items:
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if item.get("role") not in _INPUT_ROLES or kind not in (None, "message"):
            return False  # an answer, a tool call or its result
        content = item.get("content")
        if isinstance(content, list) and any(
                isinstance(b, Mapping) and b.get("type") in ("tool_result", "tool_use")
                for b in content):
            return False
    return True


def stream_error(spec: ApiSpec, status: int, message: str) -> bytes:
    """An error inside an SSE stream of ``spec``'s API, which then ends: Anthropic's
    ``error`` event, the Responses API's ``error`` event, the Gemini API's error object
    (raw JSON, as that API sends it), or a chat ``data:`` error and ``[DONE]``."""
    if spec.gemini:
        return gemini_error_event(status, message)
    if spec.anthropic:
        return b"event: error\ndata: " + json.dumps(
            anthropic_error_body(status, message)).encode() + b"\n\n"
    if spec.path == RESPONSES:
        return b"event: error\ndata: " + json.dumps(
            {"type": "error", "code": str(status), "message": message, "param": None}
        ).encode() + b"\n\n"
    return sse_error(status, message)


def last_turn_text(spec: ApiSpec, body: Mapping[str, Any]) -> str:
    """The text of the request's last turn (the new part of a growing conversation):
    the last message's or input item's text (Gemini: content), or a completion's
    prompt."""
    if spec.gemini:
        return gemini.last_turn_text(body)
    key = "messages" if spec.anthropic or spec.path == CHAT else (
        "input" if spec.path == RESPONSES else "prompt")
    items = body.get(key)
    if isinstance(items, str):
        return items
    if not isinstance(items, list) or not items:
        return ""
    last = items[-1]
    if isinstance(last, Mapping):
        return _text(last.get("content", last.get("output")))
    return _text(items) if key == "prompt" else ""
