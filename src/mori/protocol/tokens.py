"""Prompt sizes without a tokenizer: the rule the simulated engine counts by, and the
gateway's estimate when no engine counts for it.

Text is one token per ``CHARS_PER_TOKEN`` characters, rounded up, at least 1: the text of
all messages of a chat request (string contents, and the strings and ``text`` of content
parts), or a completion's prompt (a batch of one prompt is that prompt; a list of token
ids counts its length). ``prompt_tokens`` takes the synthetic ``mori.prompt_tokens``
(``mori.protocol.fields``) first.

``strict`` (the simulated engine): a body the rule cannot count is refused with a
``RequestError``. Not strict (the gateway, whose engines may take more, e.g. a batch of
prompts): what cannot be counted by the rule counts as best it can, never an error: a
content that is no text as 0 characters, each element of a batch as its characters (a
string) or one token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mori.protocol.errors import RequestError
from mori.protocol.fields import is_chat, synthetic_sizes

CHARS_PER_TOKEN = 4
"""Characters of text per token, the rule's one constant."""


def chars_to_tokens(chars: int) -> int:
    """ceil(chars / ``CHARS_PER_TOKEN``), at least 1."""
    return max(1, -(-chars // CHARS_PER_TOKEN))


def _token_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def _content_chars(content: Any, strict: bool) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        n = 0
        for part in content:
            if isinstance(part, str):
                n += len(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                n += len(part["text"])
        return n
    if strict:
        raise RequestError(400, "a message content must be a string or a list of parts",
                           "messages")
    return 0


def _chat_chars(messages: Any, strict: bool) -> int:
    if not isinstance(messages, list) or not messages:
        if strict:
            raise RequestError(400, "messages must be a non-empty list", "messages")
        return 0
    chars = 0
    for m in messages:
        if isinstance(m, Mapping):
            chars += _content_chars(m.get("content"), strict)
        elif strict:
            raise RequestError(400, "each message must be an object", "messages")
    return chars


def text_prompt_tokens(path: str, body: Mapping[str, Any], *, strict: bool = True) -> int:
    """The prompt's tokens by the text rule (see the module doc), ignoring ``mori``."""
    if is_chat(path):
        return chars_to_tokens(_chat_chars(body.get("messages"), strict))
    prompt: Any = body.get("prompt")
    one = prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        one = prompt[0]  # a batch of one
    if isinstance(one, str):
        return chars_to_tokens(len(one))
    if _token_ids(one):
        return len(one)
    if strict:
        raise RequestError(400, "prompt must be a string, a list of one string, or a list of "
                           "token ids (batched prompts are not supported)", "prompt")
    if isinstance(prompt, list):
        return chars_to_tokens(sum(len(x) if isinstance(x, str) else CHARS_PER_TOKEN
                                   for x in prompt))
    return 1


def prompt_tokens(path: str, body: Mapping[str, Any]) -> int:
    """A request's prompt tokens as the simulated engine counts them: the synthetic
    ``mori.prompt_tokens`` (at least 1) if the body has it, else the text rule (strict)."""
    synthetic, _ = synthetic_sizes(body)
    if synthetic is not None:
        return max(1, synthetic)
    return text_prompt_tokens(path, body)
