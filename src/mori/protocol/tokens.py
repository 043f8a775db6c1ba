"""Prompt sizes without a tokenizer: the rule the simulated engine counts by, and the
gateway's estimate when no engine counts for it.

Text is one token per ``CHARS_PER_TOKEN`` characters, rounded up, at least 1, of the
characters the model reads, by path (a query string such as ``?beta=true`` is ignored):

- chat (``/v1/chat/completions``): the text of all messages (string contents, and the
  strings and ``text`` of content parts). Tools are not counted (the rule predates them).
- completions (``/v1/completions``): the prompt (a batch of one prompt is that prompt; a
  list of token ids counts its length).
- Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``): ``system`` (a
  string or text blocks), every message's ``content`` (a string or blocks: ``text``
  its text; ``tool_use`` its name and its ``input`` as compact JSON; ``tool_result`` its
  ``content``, a string or text blocks; any other block, such as ``image``, ``document``
  or ``thinking``, 0), and each ``tools`` definition as compact JSON.
- OpenAI Responses (``/v1/responses``): ``instructions``, ``input`` (a string, or items:
  ``message`` its content, a string or parts whose ``input_text`` / ``output_text`` /
  ``text`` count their text; ``function_call`` its name and arguments;
  ``function_call_output`` its output, a string or parts; ``custom_tool_call`` its name
  and input; ``custom_tool_call_output`` its output; ``reasoning`` its summary texts;
  other items 0), and each ``tools`` definition as compact JSON. What
  ``previous_response_id`` refers to is not counted (the engine keeps no responses).

Compact JSON is ``json.dumps`` with no spaces and non-ASCII characters kept, the tool
definitions as the client sent them. ``prompt_tokens`` takes the synthetic
``mori.prompt_tokens`` (``mori.protocol.fields``) first.

``strict`` (the simulated engine): a body the rule cannot count is refused with a
``RequestError`` (400) whose ``param`` names the field at fault (``messages[2].content``,
``input[0].arguments``). Not strict (the gateway, whose engines may take more, e.g. a
batch of prompts): what cannot be counted by the rule counts as best it can, never an
error: a malformed part as 0 characters, each element of a batch as its characters (a
string) or one token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from mori.protocol.errors import RequestError
from mori.protocol.fields import COUNT_TOKENS, MESSAGES, RESPONSES, is_chat, synthetic_sizes

_encode = msgspec.json.Encoder().encode

CHARS_PER_TOKEN = 4
"""Characters of text per token, the rule's one constant."""


def chars_to_tokens(chars: int) -> int:
    """ceil(chars / ``CHARS_PER_TOKEN``), at least 1."""
    return max(1, -(-chars // CHARS_PER_TOKEN))


def compact_json(value: Any) -> str:
    """``value`` as the rule counts JSON: no spaces, non-ASCII characters kept (what
    ``json.dumps(value, separators=(",", ":"), ensure_ascii=False)`` writes, made by
    msgspec: a tenth of the time for an agent's tool schemas)."""
    return _encode(value).decode("utf-8")


def is_messages(path: str) -> bool:
    """Whether ``path`` (a query string allowed) is Anthropic's Messages API or its
    ``count_tokens``."""
    route = path.partition("?")[0].rstrip("/")
    return route.endswith((MESSAGES, COUNT_TOKENS))


def is_responses(path: str) -> bool:
    """Whether ``path`` (a query string allowed) is OpenAI's Responses API."""
    return path.partition("?")[0].rstrip("/").endswith(RESPONSES)


def _bad(strict: bool, where: str, what: str) -> int:
    """A shape the rule cannot count: ``RequestError`` naming ``where`` (strict), else 0."""
    if strict:
        raise RequestError(400, f"invalid '{where}': {what}", where)
    return 0


def _token_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt)


# -- chat ---------------------------------------------------------------------------------

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


# -- shared by Messages and Responses -----------------------------------------------------

def _str_chars(obj: Mapping[str, Any], key: str, where: str, strict: bool) -> int:
    value = obj.get(key)
    if isinstance(value, str):
        return len(value)
    return _bad(strict, f"{where}.{key}", "must be a string")


def _json_chars(value: Any, where: str, strict: bool) -> int:
    try:
        return len(compact_json(value))
    except (ValueError, TypeError, RecursionError):
        return _bad(strict, where, "cannot be read as JSON")


def _tools_chars(tools: Any, strict: bool) -> int:
    if tools is None:
        return 0
    if not isinstance(tools, list):
        return _bad(strict, "tools", "must be an array of tool definitions")
    if all(isinstance(tool, Mapping) for tool in tools):
        # one encoding of the array: its brackets and commas are not the tools'
        return max(0, _json_chars(tools, "tools", strict) - 1 - len(tools))
    n = 0
    for i, tool in enumerate(tools):
        if isinstance(tool, Mapping):
            n += _json_chars(tool, f"tools[{i}]", strict)
        else:
            n += _bad(strict, f"tools[{i}]", "must be an object")
    return n


def _each(items: list[Any], where: str, strict: bool,
          count: Callable[[Any, str, bool], int]) -> int:
    """``count`` summed over ``items``, each named ``where[i]``; the names serve only the
    errors of the strict rule, so the estimate does not build them."""
    if not strict:
        return sum(count(x, where, False) for x in items)
    return sum(count(x, f"{where}[{i}]", True) for i, x in enumerate(items))


def _text_or_each(content: Any, where: str, strict: bool,
                  count: Callable[[Any, str, bool], int], what: str) -> int:
    """A string's characters, or ``count`` summed over an array of ``what``."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return _bad(strict, where, f"must be a string or an array of {what}")
    return _each(content, where, strict, count)


# -- Anthropic Messages -------------------------------------------------------------------

def _block_chars(block: Any, where: str, strict: bool) -> int:
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        return _bad(strict, where, "must be a content block (an object with a 'type')")
    kind = block["type"]
    if kind == "text":
        return _str_chars(block, "text", where, strict)
    if kind == "tool_use":
        n = _str_chars(block, "name", where, strict)
        tool_input = block.get("input")
        if not isinstance(tool_input, Mapping):
            return n + _bad(strict, where + ".input", "must be an object")
        return n + _json_chars(tool_input, where + ".input" if strict else where, strict)
    if kind == "tool_result":
        content = block.get("content")
        return 0 if content is None else _blocks_chars(
            content, where + ".content" if strict else where, strict)
    return 0


def _blocks_chars(content: Any, where: str, strict: bool) -> int:
    """A string, or an array of content blocks."""
    return _text_or_each(content, where, strict, _block_chars, "content blocks")


def _message_chars(message: Any, where: str, strict: bool) -> int:
    if not isinstance(message, Mapping):
        return _bad(strict, where, "must be an object")
    n = 0
    # "user" and "assistant"; Claude Code 2.1 also sends "system" messages mid-conversation
    if not isinstance(message.get("role"), str):
        n += _bad(strict, where + ".role", "must be a string ('user', 'assistant')")
    return n + _blocks_chars(message.get("content"), where + ".content" if strict else where,
                             strict)


def messages_chars(body: Mapping[str, Any], strict: bool = True) -> int:
    """The characters of an Anthropic Messages body by the rule (see the module doc)."""
    system = body.get("system")
    n = 0 if system is None else _blocks_chars(system, "system", strict)
    n += _tools_chars(body.get("tools"), strict)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return n + _bad(strict, "messages", "must be a non-empty array of messages")
    return n + _each(messages, "messages", strict, _message_chars)


# -- OpenAI Responses ---------------------------------------------------------------------

_TEXT_PARTS = ("input_text", "output_text", "text")


def _part_chars(part: Any, where: str, strict: bool) -> int:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        return _bad(strict, where, "must be a content part (an object with a 'type')")
    if part["type"] in _TEXT_PARTS:
        return _str_chars(part, "text", where, strict)
    return 0


def _parts_chars(content: Any, where: str, strict: bool) -> int:
    """A string, or an array of content parts."""
    return _text_or_each(content, where, strict, _part_chars, "content parts")


def _summary_chars(summary: Any, where: str, strict: bool) -> int:
    if summary is None:
        return 0
    if not isinstance(summary, list):
        return _bad(strict, where, "must be an array of summary parts")
    n = 0
    for j, part in enumerate(summary):
        if isinstance(part, Mapping):
            n += _str_chars(part, "text", f"{where}[{j}]", strict)
        else:
            n += _bad(strict, f"{where}[{j}]", "must be an object")
    return n


def _item_chars(item: Any, where: str, strict: bool) -> int:
    if not isinstance(item, Mapping):
        return _bad(strict, where, "must be an input item (an object)")
    kind = item.get("type", "message")
    if kind == "message":
        return _parts_chars(item.get("content"), where + ".content", strict)
    if kind == "function_call":
        return (_str_chars(item, "name", where, strict)
                + _str_chars(item, "arguments", where, strict))
    if kind == "custom_tool_call":
        return _str_chars(item, "name", where, strict) + _str_chars(item, "input", where, strict)
    if kind in ("function_call_output", "custom_tool_call_output"):
        return _parts_chars(item.get("output"), where + ".output", strict)
    if kind == "reasoning":
        return _summary_chars(item.get("summary"), where + ".summary", strict)
    return 0


def responses_chars(body: Mapping[str, Any], strict: bool = True) -> int:
    """The characters of an OpenAI Responses body by the rule (see the module doc)."""
    instructions = body.get("instructions")
    n = 0
    if isinstance(instructions, str):
        n += len(instructions)
    elif instructions is not None:
        n += _bad(strict, "instructions", "must be a string")
    n += _tools_chars(body.get("tools"), strict)
    items = body.get("input")
    if isinstance(items, str):
        return n + len(items)
    if not isinstance(items, list):
        return n + _bad(strict, "input", "must be a string or an array of input items")
    return n + _each(items, "input", strict, _item_chars)


# -- the rule -------------------------------------------------------------------------------

def _completion_tokens(body: Mapping[str, Any], strict: bool) -> int:
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


def text_prompt_tokens(path: str, body: Mapping[str, Any], *, strict: bool = True) -> int:
    """The prompt's tokens by the text rule (see the module doc), ignoring ``mori``."""
    if is_chat(path.partition("?")[0]):
        return chars_to_tokens(_chat_chars(body.get("messages"), strict))
    if is_messages(path):
        return chars_to_tokens(messages_chars(body, strict))
    if is_responses(path):
        return chars_to_tokens(responses_chars(body, strict))
    return _completion_tokens(body, strict)


def prompt_tokens(path: str, body: Mapping[str, Any]) -> int:
    """A request's prompt tokens as the simulated engine counts them: the synthetic
    ``mori.prompt_tokens`` (at least 1) if the body has it, else the text rule (strict)."""
    synthetic, _ = synthetic_sizes(body)
    if synthetic is not None:
        return max(1, synthetic)
    return text_prompt_tokens(path, body)
