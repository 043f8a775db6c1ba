"""What a Gemini conversation (``systemInstruction``, ``contents``) says for program
identity, as ``mori.protocol.apis`` reads the other APIs: its head (the system
instruction and the first user turn), its turns (role ``model``: the model's answers,
sent back as the client got them), whether its new turns return function results
(``functionResponse`` parts after the last ``model`` turn), whether it is a side request
(no tools, no model turn, no function call or response), and its last turn's text.

Never raises: a malformed body (checked elsewhere) reads as what can be read of it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _parts(content: Any) -> list[Any]:
    parts = content.get("parts") if isinstance(content, Mapping) else None
    return parts if isinstance(parts, list) else []


def _part_text(part: Any) -> str | None:
    """A part's text: its ``text``, or a function response's output (Gemini CLI's
    ``{"output": text}``) or compact JSON; None for other parts."""
    if not isinstance(part, Mapping):
        return None
    text = part.get("text")
    if isinstance(text, str):
        return text
    fr = part.get("functionResponse")
    if isinstance(fr, Mapping):
        response = fr.get("response")
        if isinstance(response, Mapping) and isinstance(response.get("output"), str):
            return str(response["output"])
        try:
            return json.dumps(response, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError):
            return ""
    return None


def content_text(content: Any) -> str:
    """The text of a ``Content`` (its parts' texts, a line each), or of a string."""
    if isinstance(content, str):
        return content
    return "\n".join(t for p in _parts(content) if (t := _part_text(p)) is not None)


def _contents(body: Mapping[str, Any]) -> list[Any]:
    contents = body.get("contents")
    return contents if isinstance(contents, list) else []


def _role(content: Any) -> Any:
    return content.get("role", "user") if isinstance(content, Mapping) else None


def _has(content: Any, key: str) -> bool:
    return any(isinstance(p, Mapping) and key in p for p in _parts(content))


def conversation_head(body: Mapping[str, Any]) -> str:
    """The system instruction and the first user turn's text."""
    parts = [content_text(body.get("systemInstruction"))]
    for content in _contents(body):
        if _role(content) == "user":
            parts.append(content_text(content))
            break
    return "\n".join(parts)


def conversation_items(body: Mapping[str, Any]) -> tuple[str, list[tuple[bool, Any]]]:
    """The system instruction's text and the turns, each ``(answer, content)``:
    ``answer`` for the model's (role ``model``)."""
    system = content_text(body.get("systemInstruction"))
    return system, [(_role(c) == "model", c) for c in _contents(body)]


def carries_tool_results(body: Mapping[str, Any]) -> bool:
    """Whether a turn after the last ``model`` turn holds a ``functionResponse``."""
    for content in reversed(_contents(body)):
        if _role(content) == "model":
            return False
        if _has(content, "functionResponse"):
            return True
    return False


def is_side_request(body: Mapping[str, Any]) -> bool:
    """No tools, and no model turn, function call or function response in it."""
    contents = body.get("contents")
    if body.get("tools") or not isinstance(contents, list):
        return False
    return not any(_role(c) == "model" or _has(c, "functionCall")
                   or _has(c, "functionResponse") for c in contents)


def last_turn_text(body: Mapping[str, Any]) -> str:
    """The text of the last turn (the new part of a growing conversation)."""
    contents = _contents(body)
    return content_text(contents[-1]) if contents else ""
