"""What the simulated engine answers: the text and the tool call of a request's answer, and
how many output tokens it takes.

- Unscripted chat and completions requests (and every completions request): exactly
  ``max_tokens`` placeholder words (default ``DEFAULT_MAX_TOKENS``), one word per token,
  cut at the limit (``Stop.LENGTH``), as a load generator expects.
- Unscripted Messages and Responses requests (whose clients ask for a large
  ``max_tokens``, Claude Code 32000): ``DEFAULT_MAX_TOKENS`` placeholder words, or
  ``max_tokens`` words (cut, ``Stop.LENGTH``) when that is fewer.
- Scripted requests on chat, Messages and Responses (``mori.sim.script``): the script's
  text and tool call for the request's step; the output tokens are the answer's tokens
  by the text rule (``mori.protocol.tokens``: the text, then the tool's name and its
  input as compact JSON), capped at ``max_tokens``. An answer cut at the cap keeps its
  text up to the cut and loses its tool call (``Stop.LENGTH``).

A script's ``{{result.NAME}}`` strings are filled from the request's last tool result
(``last_tool_result``). The step of a request (see ``mori.sim.script``): ``script_step`` counts the tool results
after the conversation's last prompt (Anthropic ``tool_result`` blocks, Responses
``function_call_output`` / ``custom_tool_call_output`` items, chat ``role: "tool"``
messages); a prompt is a user message with no tool result that is no notification of background
work (a text holding a tag of ``NOTIFICATION_TAGS``: Claude Code's
``<task-notification>`` when a background subagent ends, Codex's
``<subagent_notification>``), so such a notification goes on with the script where it
was instead of starting it again. ``offered_tools`` reads the tool
names a request offers (Anthropic ``tools[].name``, Responses ``tools[].name`` of
``type: "function"`` and, for the tools of a ``type: "namespace"`` tool such as Codex's
``multi_agent_v1``, both ``name`` and ``namespace.name``; chat
``tools[].function.name``); a call of a namespaced tool carries its ``namespace``
(``ToolCall.namespace``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, overload

from mori.protocol.tokens import CHARS_PER_TOKEN, chars_to_tokens
from mori.sim.script import RESULT_MARK, Script, ScriptTool

DEFAULT_MAX_TOKENS = 16
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
          "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore",
          "magna", "aliqua")


class Api(StrEnum):
    """The request APIs the engine serves."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    RESPONSES = "responses"


class Stop(StrEnum):
    """Why an answer ends: its text is done, it calls a tool, or it hit ``max_tokens``."""

    END = "end"
    TOOL = "tool"
    LENGTH = "length"


def token_text(i: int) -> str:
    """The text of placeholder token ``i``: one word, space-separated."""
    word = _WORDS[i % len(_WORDS)]
    return word if i == 0 else " " + word


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call of an answer: ``key`` is random hex that each API prefixes into its
    call id (``toolu_``, ``call_``)."""

    name: str
    arguments: str  # the input, compact JSON of an object
    key: str
    namespace: str | None = None  # a Responses namespace tool's name (Codex's subagents)

    @property
    def input(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.arguments)
        return value


@dataclass(frozen=True, slots=True)
class Answer:
    """A request's answer as it is generated: one piece per output token, the text's
    ``text_tokens`` first (``text_pieces``, read by index), then the tool call's (its
    name's tokens add nothing, then the arguments)."""

    text_tokens: int
    text_pieces: Sequence[str]
    tool: ToolCall | None
    tool_pieces: tuple[str, ...]
    stop: Stop

    @property
    def tokens(self) -> int:
        return self.text_tokens + len(self.tool_pieces)

    @property
    def text(self) -> str:
        return "".join(self.text_pieces[i] for i in range(self.text_tokens))

    def is_text(self, i: int) -> bool:
        """Whether output token ``i`` belongs to the text (else to the tool call)."""
        return i < self.text_tokens

    def piece(self, i: int) -> str:
        """What output token ``i`` adds to the text or to the tool call's arguments."""
        n = self.text_tokens
        return self.text_pieces[i] if i < n else self.tool_pieces[i - n]


def _chunks(text: str) -> tuple[str, ...]:
    """``text`` in pieces of ``CHARS_PER_TOKEN`` characters (none for no text)."""
    return tuple(text[i:i + CHARS_PER_TOKEN] for i in range(0, len(text), CHARS_PER_TOKEN))


class _Words(Sequence[str]):
    """``n`` placeholder words, made when read: a request asking for more tokens than the
    engine's context holds is refused by the engine, not spelled out first (``len`` fails
    past ``sys.maxsize``: ``Answer.text_tokens`` holds the count)."""

    __slots__ = ("_n",)

    def __init__(self, n: int) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [token_text(j) for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return token_text(i % self._n)


def placeholder(tokens: int, stop: Stop) -> Answer:
    """``tokens`` placeholder words."""
    return Answer(tokens, _Words(tokens), None, (), stop)


def exact_placeholder(max_tokens: int | None) -> Answer:
    """The chat / completions answer: exactly ``max_tokens`` words (default 16)."""
    return placeholder(max_tokens or DEFAULT_MAX_TOKENS, Stop.LENGTH)


def short_placeholder(max_tokens: int | None) -> Answer:
    """The Messages / Responses answer: 16 words, fewer (cut) under ``max_tokens``."""
    if max_tokens is not None and max_tokens < DEFAULT_MAX_TOKENS:
        return placeholder(max_tokens, Stop.LENGTH)
    return placeholder(DEFAULT_MAX_TOKENS, Stop.END)


def text_answer(text: str, tool: ScriptTool | None, max_tokens: int | None,
                namespaces: Mapping[str, str] | None = None) -> Answer:
    """``text`` then ``tool``'s call, sized by the text rule and capped at ``max_tokens``;
    ``namespaces`` maps an offered namespaced tool's names (``name``, ``namespace.name``)
    to its namespace: the call then names the tool without it and carries it apart."""
    text_pieces = _chunks(text)
    call = None
    if tool is not None:
        namespace = (namespaces or {}).get(tool.name)
        name = tool.name.removeprefix(namespace + ".") if namespace else tool.name
        call = ToolCall(name, tool.arguments, uuid.uuid4().hex, namespace)
    tool_pieces: tuple[str, ...] = ()
    if call is not None:
        name_tokens = chars_to_tokens(len(call.name))
        tool_pieces = ("",) * name_tokens + _chunks(call.arguments)
    if not text_pieces and not tool_pieces:
        text_pieces = ("",)  # at least one token
    total = len(text_pieces) + len(tool_pieces)
    if max_tokens is not None and total > max_tokens:
        cut = text_pieces[:max_tokens]
        return Answer(max_tokens, cut + ("",) * (max_tokens - len(cut)), None, (), Stop.LENGTH)
    return Answer(len(text_pieces), text_pieces, call, tool_pieces,
                  Stop.END if call is None else Stop.TOOL)


# -- reading the request ------------------------------------------------------------------

NOTIFICATION_TAGS = ("<task-notification>", "<subagent_notification>")
"""The tags of a user message that tells the model of background work (Claude Code's
background subagent ending, Codex's subagent reaching a final status): not a prompt."""


def _names(tools: Any, api: Api) -> list[str]:
    if not isinstance(tools, list):
        return []
    names = []
    for t in tools:
        if not isinstance(t, Mapping):
            continue
        if api is Api.CHAT:
            fn = t.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
        elif api is Api.RESPONSES:
            name = t.get("name") if t.get("type") == "function" else None
        else:
            name = t.get("name")
        if isinstance(name, str):
            names.append(name)
    return names


def tool_namespaces(api: Api, body: Mapping[str, Any]) -> dict[str, str]:
    """The tools a Responses request offers inside ``type: "namespace"`` tools, by both
    their names (``spawn_agent``, ``multi_agent_v1.spawn_agent``), to their namespace;
    the first namespace wins a bare name offered in several, and a bare name that is
    also offered outside any namespace is that tool's. Empty for the other APIs."""
    tools = body.get("tools")
    if api is not Api.RESPONSES or not isinstance(tools, list):
        return {}
    top = set(_names(tools, api))  # a tool offered outside any namespace keeps its name
    out: dict[str, str] = {}
    for t in tools:
        if not isinstance(t, Mapping) or t.get("type") != "namespace":
            continue
        namespace = t.get("name")
        if not isinstance(namespace, str) or not namespace:
            continue
        for name in _names(t.get("tools"), api):
            if name not in top:
                out.setdefault(name, namespace)
            out.setdefault(f"{namespace}.{name}", namespace)
    return out


def offered_tools(api: Api, body: Mapping[str, Any]) -> list[str]:
    """The names of the tools a request offers (see the module doc)."""
    return _names(body.get("tools"), api) + list(tool_namespaces(api, body))


def _blocks(content: Any) -> list[Mapping[str, Any]]:
    if not isinstance(content, list):
        return []
    return [b for b in content if isinstance(b, Mapping)]


def _texts(content: Any) -> list[str]:
    """A message's texts: its content string, or its text blocks' texts."""
    if isinstance(content, str):
        return [content]
    return [b["text"] for b in _blocks(content) if isinstance(b.get("text"), str)]


def is_notification(content: Any) -> bool:
    """Whether a user message tells of background work: one of its texts holds a tag of
    ``NOTIFICATION_TAGS`` (Claude Code wraps it in a ``<system-reminder>``, after other
    reminders)."""
    return any(tag in text for text in _texts(content) for tag in NOTIFICATION_TAGS)


def _messages_step(messages: list[Any]) -> int:
    step = 0
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") != "user":
            continue
        content = m.get("content")
        results = sum(b.get("type") == "tool_result" for b in _blocks(content))
        if results:
            step += results
        elif not is_notification(content):
            step = 0
    return step


def _responses_step(items: list[Any]) -> int:
    step = 0
    for x in items:
        if not isinstance(x, Mapping):
            continue
        kind = x.get("type", "message")
        if kind in ("function_call_output", "custom_tool_call_output"):
            step += 1
        elif (kind == "message" and x.get("role") == "user"
              and not is_notification(x.get("content"))):
            step = 0
    return step


def _chat_step(messages: list[Any]) -> int:
    step = 0
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        if m.get("role") == "tool":
            step += 1
        elif m.get("role") == "user" and not is_notification(m.get("content")):
            step = 0
    return step


def _result_text(content: Any) -> str | None:
    """A tool result's text: a string, or its text parts joined."""
    texts = _texts(content)
    return "".join(texts) if texts else None


def last_tool_result(api: Api, body: Mapping[str, Any]) -> str | None:
    """The text of the last tool result of a request's conversation (None: none)."""
    key = "input" if api is Api.RESPONSES else "messages"
    conversation = body.get(key)
    if not isinstance(conversation, list):
        return None
    for x in reversed(conversation):
        if not isinstance(x, Mapping):
            continue
        if api is Api.RESPONSES:
            if x.get("type") in ("function_call_output", "custom_tool_call_output"):
                return _result_text(x.get("output"))
        elif api is Api.MESSAGES:
            results = [b for b in _blocks(x.get("content")) if b.get("type") == "tool_result"]
            if x.get("role") == "user" and results:
                return _result_text(results[-1].get("content"))
        elif x.get("role") == "tool":
            return _result_text(x.get("content"))
    return None


def script_step(api: Api, body: Mapping[str, Any]) -> int:
    """The script step of a request: tool results after its last prompt."""
    key = "input" if api is Api.RESPONSES else "messages"
    conversation = body.get(key)
    if not isinstance(conversation, list):
        return 0
    if api is Api.MESSAGES:
        return _messages_step(conversation)
    if api is Api.RESPONSES:
        return _responses_step(conversation)
    return _chat_step(conversation)


def scripted_answer(script: Script, api: Api, body: Mapping[str, Any],
                    max_tokens: int | None) -> Answer:
    """The script's answer to a request (the rule: ``mori.sim.script``)."""
    offered = offered_tools(api, body)
    if not offered:
        return text_answer(script.fallback, None, max_tokens)
    k = script_step(api, body)
    if k >= len(script.steps):
        return text_answer(script.final_text, None, max_tokens)
    step = script.steps[k]
    tool = step.tool_for(offered)
    if tool is not None and RESULT_MARK in tool.arguments:
        tool = tool.filled(last_tool_result(api, body))
    text = step.text or ("" if tool is not None else script.fallback)
    return text_answer(text, tool, max_tokens, tool_namespaces(api, body))


def answer_for(api: Api, body: Mapping[str, Any], script: Script | None,
               max_tokens: int | None) -> Answer:
    """A request's answer (see the module doc); ``max_tokens`` as validated (None:
    not given)."""
    if api is Api.COMPLETIONS or (script is None and api is Api.CHAT):
        return exact_placeholder(max_tokens)
    if script is None:
        return short_placeholder(max_tokens)
    return scripted_answer(script, api, body, max_tokens)
