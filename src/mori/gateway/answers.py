"""Reading an engine's answer as it passes: usage, cached tokens, the tools it called.

One reader per API shape (``watcher_for``): ``ChatWatcher`` for OpenAI's chat and
completions streams, ``MessagesWatcher`` for Anthropic's Messages stream, and
``ResponsesWatcher`` for OpenAI's Responses stream. Each takes the SSE bytes chunk by
chunk (``feed``) and keeps what the step's end needs (``Answer``): the prompt tokens the
engine reported, those it read from its cache, the output tokens (the usage, else the
content events counted), and the tool calls the answer ended in (``tool_use`` blocks,
``function_call`` items, ``tool_calls``). Only lines that can carry those are parsed as
JSON; the rest are counted by scanning. ``read_answer`` reads a complete (non-streamed)
answer of any API.

Every stream may carry the simulated engine's ``: kv-ready`` comment
(``mori.protocol.fields.KV_READY_LINE``); the watchers note it. A watcher splits the
stream into lines in time linear in the bytes, with a cap on one line
(``mori.protocol.sse``), and ``feed`` returns the whole lines, which is what the gateway
passes on: the start of a line is held until its end arrives. ``StepUsage.bounded``
clamps an answer's counts to what one request can hold.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mori.protocol.apis import ApiSpec
from mori.protocol.fields import KV_READY_LINE, RESPONSES
from mori.protocol.sse import DEFAULT_MAX_SSE_LINE_BYTES, LineBuffer


@dataclass(slots=True)
class Answer:
    """What an answer said of its step (None: not reported)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    tool_names: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepUsage:
    """The token counts a step is booked with: ``prompt``, of which ``cached`` were read
    from the engine's cache (None: not reported), and ``output``."""

    prompt: int
    cached: int | None
    output: int

    def bounded(self, max_prompt: int | None, max_output: int | None) -> StepUsage:
        """These counts clamped to what can be true of one request: a prompt of at most
        ``max_prompt`` (the engine's context window), an output of at most
        ``max_output`` (the request's limit, or the context window), a cache read within
        the prompt (None: no bound). An engine's numbers are otherwise trusted, and a
        wrong one would stay in the counters and the trace for good."""
        prompt = self.prompt if max_prompt is None else min(self.prompt, max_prompt)
        output = self.output if max_output is None else min(self.output, max_output)
        cached = None if self.cached is None else min(self.cached, prompt)
        return StepUsage(prompt, cached, output)


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _openai_usage(u: Any, ans: Answer) -> None:
    """Chat / completions usage (``prompt_tokens``, ``completion_tokens``, cached in
    ``prompt_tokens_details``) or Responses usage (``input_tokens``, ``output_tokens``,
    cached in ``input_tokens_details``)."""
    if not isinstance(u, dict):
        return
    p = _int(u.get("prompt_tokens", u.get("input_tokens")))
    c = _int(u.get("completion_tokens", u.get("output_tokens")))
    details = u.get("prompt_tokens_details", u.get("input_tokens_details"))
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    if p is not None:
        ans.prompt_tokens = p
    if c is not None:
        ans.completion_tokens = c
    if cached is not None:
        ans.cached_tokens = cached


def _anthropic_usage(u: Any, ans: Answer) -> None:
    """Messages usage: ``input_tokens`` are those *not* read from the cache; the prompt is
    ``input + cache_read + cache_creation``."""
    if not isinstance(u, dict):
        return
    parts = [_int(u.get(k)) for k in ("input_tokens", "cache_read_input_tokens",
                                       "cache_creation_input_tokens")]
    if parts[0] is not None:
        ans.prompt_tokens = sum(x or 0 for x in parts)
    if parts[1] is not None:
        ans.cached_tokens = parts[1]
    out = _int(u.get("output_tokens"))
    if out is not None:
        ans.completion_tokens = max(out, ans.completion_tokens or 0)


def _tool_names_chat(message: Any) -> list[str]:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    names = []
    for c in calls if isinstance(calls, list) else ():
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


_RESPONSES_CALLS = ("function_call", "custom_tool_call", "local_shell_call")


def _tool_name_item(item: Any) -> str | None:
    """The tool a Responses output item calls, None if it calls none."""
    if not isinstance(item, dict) or item.get("type") not in _RESPONSES_CALLS:
        return None
    name = item.get("name")
    return name if isinstance(name, str) else str(item.get("type"))


_LONG = 1 << 16
"""A line held over more than this many bytes is read as it comes (``_Lines``)."""


class _Lines:
    """Splits a byte stream into SSE lines across chunks (``mori.protocol.sse``: linear in
    the bytes, one line at most ``max_line`` bytes); ``feed`` reads the ``data:``
    payloads of the whole lines a chunk completes (``_read``), notes the kv-ready
    comment, and returns those lines as pieces, to be passed on. What ``feed`` has not
    returned is the start of a line yet to end (``rest``).

    A line that comes in pieces is searched for the watcher's ``markers`` piece by piece
    as it arrives; once its end comes, a long one (over ``_LONG`` bytes) in which none
    that matters was found is counted without being joined or read again
    (``_skip_long``): a line of many MiB costs the event loop no pass over it at its
    end, when its pieces are passed on one by one."""

    markers: tuple[bytes, ...] = ()
    """What makes a line worth reading: any other is only counted."""
    __slots__ = ("_lines", "kv_ready", "events", "answer", "_found", "_edge")

    def __init__(self, max_line: int = DEFAULT_MAX_SSE_LINE_BYTES) -> None:
        self._lines = LineBuffer(max_line)
        self.kv_ready = False
        self.events = 0
        self.answer = Answer()
        self._found: set[bytes] = set()  # markers seen in the line held so far
        self._edge = b""  # the held line's last bytes, for a marker cut between pieces

    def feed(self, chunk: bytes) -> list[bytes]:
        """Read the whole lines ``chunk`` completes and return them as pieces ([] if
        none); ``LineTooLong`` (``mori.protocol.sse``) when a line passes the cap."""
        held = self._lines.held
        pieces = self._lines.feed(chunk)
        if not pieces:
            self._search(chunk)
            return pieces
        if len(pieces) == 1:
            self._read_lines(pieces[0])
        else:
            last = pieces[-1]
            nl = last.find(b"\n")
            if held + nl <= _LONG:  # a short line cut between chunks: joined, read as any
                self._read_lines(b"".join(pieces))
            else:
                self._search(last[:nl])
                head = b"".join(pieces[:2])[:5] if len(pieces[0]) < 5 else pieces[0]
                if not self._skip_long(head.startswith(b"data:"), self._found):
                    self._read_lines(b"".join(pieces[:-1]) + last[:nl + 1])
                self._read_lines(last[nl + 1:])
            self._found = set()
            self._edge = b""
        if self._lines.held:  # a line begun: searched from its start
            self._search(chunk[-self._lines.held:])
        return pieces

    def _search(self, piece: bytes) -> None:
        edge = self._edge + piece[:64]
        for m in self.markers:
            if m not in self._found and (m in piece or m in edge):
                self._found.add(m)
        self._edge = (self._edge + piece)[-64:] if len(piece) < 64 else piece[-64:]

    def _read_lines(self, whole: bytes) -> None:
        out = []
        for line in whole.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:])
            elif line.rstrip(b"\r") == KV_READY_LINE:
                self.kv_ready = True
        if out:
            self._read(out)

    def _skip_long(self, data: bool, found: set[bytes]) -> bool:
        """Count a long line (a ``data:`` one if ``data``) in which ``found`` are the
        markers seen, if it needs no reading; False: it must be read."""
        raise NotImplementedError

    def rest(self) -> bytes:
        """The start of a line that never ended (the stream is over): given up, unread."""
        return self._lines.rest()

    def _read(self, payloads: list[bytes]) -> None:
        raise NotImplementedError

    def output_tokens(self) -> int:
        """The usage's output tokens, else the content events counted."""
        c = self.answer.completion_tokens
        return c if c is not None else self.events


class ChatWatcher(_Lines):
    """An OpenAI chat or completions stream (``data:`` events, ``[DONE]`` at the end).
    ``ended``: the stream said it ends (``[DONE]``, or an error event)."""

    markers = (b"[DONE]", b'"error"', b'"usage"', b'"tool_calls"')
    __slots__ = ("done", "ended")

    def _skip_long(self, data: bool, found: set[bytes]) -> bool:
        if found:
            return False
        self.events += data  # a content event
        return True

    def __init__(self, max_line: int = DEFAULT_MAX_SSE_LINE_BYTES) -> None:
        super().__init__(max_line)
        self.done = False
        self.ended = False

    def _read(self, payloads: list[bytes]) -> None:
        for raw in payloads:
            payload = raw.strip()
            if payload == b"[DONE]":
                self.done = self.ended = True
                continue
            if b'"error"' in payload:
                self.ended = True
            self.events += 1
            has_usage = (b'"usage"' in payload
                         and b'"usage":null' not in payload.replace(b" ", b""))
            if not has_usage and b'"tool_calls"' not in payload:
                continue
            try:
                data = json.loads(payload)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if not isinstance(data, dict):
                continue
            for choice in _list(data.get("choices")):
                if isinstance(choice, dict):
                    self.answer.tool_names.extend(_tool_names_chat(choice.get("delta")))
            if has_usage:
                before = self.answer.completion_tokens
                _openai_usage(data.get("usage"), self.answer)
                if before is None and self.answer.completion_tokens is not None:
                    self.events -= 1  # the usage-only event carries no token

_ERROR_EVENT = (b'"type":"error"', b'"type": "error"')
"""An error event of a typed stream (not ``"error"`` alone: a Responses object carries
``"error": null``)."""


class _TypedEvents(_Lines):
    """A stream of typed JSON events (``event: NAME`` then ``data: {"type": NAME, ...}``):
    the events in ``parse`` are read as JSON, those in ``count`` counted; ``ended``: one
    of the events in ``ends`` (the stream's last, or an error) was seen."""

    parse: tuple[bytes, ...] = ()
    count: bytes = b""
    ends: tuple[bytes, ...] = ()
    __slots__ = ("ended",)

    def __init__(self, max_line: int = DEFAULT_MAX_SSE_LINE_BYTES) -> None:
        super().__init__(max_line)
        self.ended = False

    def _skip_long(self, data: bool, found: set[bytes]) -> bool:
        if self.count in found:  # counted, never parsed (as in _read)
            self.events += data
            return True
        return not found

    def _read(self, payloads: list[bytes]) -> None:
        for payload in payloads:
            if self.count in payload:
                self.events += 1
                continue
            if any(e in payload for e in self.ends):
                self.ended = True
            if not any(p in payload for p in self.parse):
                continue
            try:
                data = json.loads(payload)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(data, dict):
                self.event(data)

    def event(self, data: dict[str, Any]) -> None:
        raise NotImplementedError


class MessagesWatcher(_TypedEvents):
    """Anthropic's Messages stream: usage in ``message_start`` (the prompt) and
    ``message_delta`` (the output), tool calls in ``content_block_start``."""

    parse = (b'"message_start"', b'"message_delta"', b'"content_block_start"')
    count = b'"content_block_delta"'
    ends = (b'"message_stop"', *_ERROR_EVENT)
    markers = (*parse, count, *ends)
    __slots__ = ()

    def event(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "message_start":
            msg = data.get("message")
            if isinstance(msg, dict):
                _anthropic_usage(msg.get("usage"), self.answer)
        elif kind == "message_delta":
            _anthropic_usage(data.get("usage"), self.answer)
        elif kind == "content_block_start":
            block = data.get("content_block")
            if isinstance(block, dict) and block.get("type") in ("tool_use",
                                                                 "server_tool_use"):
                name = block.get("name")
                self.answer.tool_names.append(name if isinstance(name, str) else "tool_use")


class ResponsesWatcher(_TypedEvents):
    """OpenAI's Responses stream: tool calls in ``response.output_item.added``, usage in
    the final ``response.completed`` (or ``.incomplete`` / ``.failed``)."""

    parse = (b'"response.output_item.added"', b'"response.completed"',
             b'"response.incomplete"', b'"response.failed"')
    count = b'"response.output_text.delta"'
    ends = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"',
            *_ERROR_EVENT)
    markers = (*parse, count, *ends)
    __slots__ = ()

    def event(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "response.output_item.added":
            name = _tool_name_item(data.get("item"))
            if name is not None:
                self.answer.tool_names.append(name)
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            resp = data.get("response")
            if isinstance(resp, dict):
                _openai_usage(resp.get("usage"), self.answer)


Watcher = ChatWatcher | MessagesWatcher | ResponsesWatcher


def watcher_for(spec: ApiSpec, max_line: int = DEFAULT_MAX_SSE_LINE_BYTES) -> Watcher:
    """A fresh stream reader for ``spec``'s API; ``max_line``: the longest SSE line it
    takes, in bytes."""
    if spec.anthropic:
        return MessagesWatcher(max_line)
    if spec.path == RESPONSES:
        return ResponsesWatcher(max_line)
    return ChatWatcher(max_line)


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _WithUsage(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_WithUsage)
"""Reads only ``usage`` of a chat answer (the rest is scanned, not built)."""


class _Counts(msgspec.Struct):
    """The token counts of a Messages or Responses usage (the fields each API has)."""

    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: dict[str, Any] | None = None


class _Part(msgspec.Struct):
    """A content block (Messages) or an output item (Responses): its type and name."""

    type: str = ""
    name: str | None = None


class _Typed(msgspec.Struct):
    usage: _Counts | None = None
    content: list[_Part] = msgspec.field(default_factory=list)
    output: list[_Part] = msgspec.field(default_factory=list)


_typed_decoder = msgspec.json.Decoder(_Typed)
"""Reads a Messages or Responses answer's usage and the types and names of its parts
(the text is scanned, not built); an answer of another shape falls back to ``json``."""


def _read_typed(spec: ApiSpec, body: bytes) -> Answer | None:
    try:
        t = _typed_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    ans = Answer()
    u = t.usage
    if spec.anthropic:
        if u is not None:
            _anthropic_usage(msgspec.structs.asdict(u), ans)
        calls = [p for p in t.content if p.type in ("tool_use", "server_tool_use")]
        ans.tool_names = [p.name if p.name is not None else "tool_use" for p in calls]
        return ans
    if u is not None:
        _openai_usage({k: v for k, v in msgspec.structs.asdict(u).items() if v is not None},
                      ans)
    ans.tool_names = [p.name if p.name is not None else p.type for p in t.output
                      if p.type in _RESPONSES_CALLS]
    return ans


def read_answer(spec: ApiSpec, body: bytes) -> Answer:
    """What a complete JSON answer of ``spec``'s API says (empty for anything else). A
    chat answer with no tool call nor cache details has only its usage read."""
    ans = Answer()
    if not spec.anthropic and spec.path != RESPONSES and b'"tool_calls"' not in body \
            and b'"cached_tokens"' not in body:
        try:
            u = _usage_decoder.decode(body).usage
        except (msgspec.DecodeError, msgspec.ValidationError):
            return ans
        if u is not None:
            ans.prompt_tokens, ans.completion_tokens = u.prompt_tokens, u.completion_tokens
        return ans
    if spec.anthropic or spec.path == RESPONSES:
        typed = _read_typed(spec, body)
        if typed is not None:
            return typed
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ans
    if not isinstance(data, dict):
        return ans
    if spec.anthropic:
        _anthropic_usage(data.get("usage"), ans)
        for block in _list(data.get("content")):
            if isinstance(block, dict) and block.get("type") in ("tool_use", "server_tool_use"):
                name = block.get("name")
                ans.tool_names.append(name if isinstance(name, str) else "tool_use")
    elif spec.path == RESPONSES:
        _openai_usage(data.get("usage"), ans)
        for item in _list(data.get("output")):
            name = _tool_name_item(item)
            if name is not None:
                ans.tool_names.append(name)
    else:
        _openai_usage(data.get("usage"), ans)
        for choice in _list(data.get("choices")):
            if isinstance(choice, dict):
                ans.tool_names.extend(_tool_names_chat(choice.get("message")))
    return ans
