"""Importer for Codex CLI rollouts (``~/.codex/sessions/**/rollout-*.jsonl``).

Each line is ``{"timestamp", "type", "payload"}`` with ``type`` one of ``session_meta``
(first line: the session ``id``), ``turn_context``, ``response_item``, ``event_msg`` or
``compacted``; any other type, or a line that is not such an object, is a bad line
(:class:`~mori.traces.errors.TraceError` naming file and line; ``skip_bad`` skips it).
Payload types not listed below are read past.

Rules (the timing rules proper are in :mod:`mori.traces.timeline`):

* One step per LLM call, closed by an ``event_msg`` of type ``token_count`` whose
  ``info.last_token_usage`` gives the call's usage (a ``token_count`` without ``info``,
  or repeating the previous one's ``total_token_usage``, is not a new call).
* ``prompt_tokens = input_tokens`` (the cached part is inside it),
  ``new_tokens = input_tokens - cached_input_tokens``, ``reuse_tokens`` from
  ``cached_input_tokens``, ``output_tokens = output_tokens`` (reasoning tokens are part
  of it). ``shared_prefix_tokens``: the first call's ``cached_input_tokens``.
* The response's items (``reasoning``, assistant ``message``, ``function_call``,
  ``custom_tool_call``, ...) precede its ``token_count``; the request is taken to start at
  the last input line before the first of them (a ``function_call_output``, a user
  message), and the response to end at the ``token_count``.
* Tool calls: ``function_call`` / ``custom_tool_call`` (``name``, ``call_id``) to the
  ``function_call_output`` / ``custom_tool_call_output`` with the same ``call_id``.
* A person acted after a response when an ``event_msg`` ``user_message`` follows it, or
  a user ``message`` item that is not injected context (its text starting with ``<``):
  that gap is ``HUMAN``.
* The program is named after ``session_meta.payload.id`` (else the file name); a
  rollout without any LLM call is left out (counted).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mori.traces.errors import Fields, TraceError
from mori.traces.import_common import (
    SKIP_HINT,
    ImportOptions,
    first_object,
    json_lines,
    parse_time,
    walk_files,
)
from mori.traces.model import ProgramTrace
from mori.traces.timeline import Call, ToolCall, build_program

FORMAT_NAME = "codex"
PROVIDER = "codex"
LINE_TYPES = frozenset({"session_meta", "turn_context", "response_item", "event_msg",
                        "compacted"})
OUTPUT_ITEMS = frozenset({"message", "reasoning", "function_call", "custom_tool_call",
                          "local_shell_call", "web_search_call"})
CALL_ITEMS = frozenset({"function_call", "custom_tool_call", "local_shell_call"})
RESULT_ITEMS = frozenset({"function_call_output", "custom_tool_call_output"})


def is_rollout_file(path: Path) -> bool:
    """Whether ``path`` is named like a rollout (``*.jsonl``, optionally gzipped)."""
    return path.name.lower().endswith((".jsonl", ".jsonl.gz"))


def looks_like_codex(path: Path) -> bool:
    """Whether ``path`` (a rollout, or a folder holding ``rollout-*.jsonl``) reads as a
    Codex rollout: its first object has ``type``, ``timestamp`` and a ``payload``
    object, the type being a rollout line type."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("rollout-*.jsonl*") if p.is_file())[:1]
    else:
        files = [path]
    for file in files:
        obj = first_object(file)
        return (obj is not None and obj.get("type") in LINE_TYPES
                and isinstance(obj.get("payload"), dict) and "timestamp" in obj)
    return False


def rollout_files(paths: Sequence[Path]) -> list[Path]:
    """The rollout files under ``paths``: files as given, ``rollout-*.jsonl[.gz]`` in
    directories (recursively, sorted)."""
    return walk_files(list(paths), lambda p: p.name.startswith("rollout-")
                      and is_rollout_file(p))


def iter_programs(paths: Sequence[Path], options: ImportOptions) -> Iterator[ProgramTrace]:
    """One program per rollout under ``paths`` (rules: module doc), streamed."""
    for file in rollout_files(paths):
        program = read_rollout(file, options)
        if program is None:
            options.report.empty_sessions += 1
            continue
        options.report.programs += 1
        options.report.steps += len(program.steps)
        yield program


@dataclass(slots=True)
class _Rollout:
    calls: list[Call] = field(default_factory=list)
    name: str | None = None
    last_input: float | None = None
    pending_t_req: float | None = None
    pending_tools: list[ToolCall] = field(default_factory=list)
    open_tools: dict[str, ToolCall] = field(default_factory=dict)
    last_total: tuple[int, ...] | None = None
    first_cached: int | None = None

    def item(self, payload: Fields, ts: float) -> None:
        kind = payload.opt_text("type")
        if kind in OUTPUT_ITEMS and not (kind == "message" and payload.opt_text("role") != "assistant"):
            if self.pending_t_req is None:
                self.pending_t_req = self.last_input if self.last_input is not None else ts
            if kind in CALL_ITEMS:
                tool = ToolCall(name=payload.text("name", kind or "?"), start=ts)
                self.pending_tools.append(tool)
                call_id = payload.opt_text("call_id") or payload.opt_text("id")
                if call_id is not None:
                    self.open_tools[call_id] = tool
        elif kind in RESULT_ITEMS:
            call_id = payload.text("call_id")
            done = self.open_tools.get(call_id)
            if done is not None:
                done.end = ts
                del self.open_tools[call_id]
            self.last_input = ts
        elif kind == "message":  # a user or developer message
            text = _text(payload)
            if payload.opt_text("role") == "user" and not text.lstrip().startswith("<"):
                self._human()
            self.last_input = ts

    def event(self, payload: Fields, ts: float) -> None:
        kind = payload.opt_text("type")
        if kind == "user_message":
            self._human()
            self.last_input = ts
        elif kind == "token_count" and payload.has("info"):
            info = payload.child(payload.raw("info"), "payload.info")
            if not info.has("last_token_usage"):
                return
            last = info.child(info.raw("last_token_usage"), "payload.info.last_token_usage")
            if info.has("total_token_usage"):
                total = info.child(info.raw("total_token_usage"),
                                   "payload.info.total_token_usage")
                key = tuple(total.integer(k, 0) for k in
                            ("input_tokens", "cached_input_tokens", "output_tokens",
                             "reasoning_output_tokens", "total_tokens"))
                if key == self.last_total:
                    return  # the same count reported again
                self.last_total = key
            self._close(last, ts)

    def _close(self, usage: Fields, ts: float) -> None:
        prompt = usage.integer("input_tokens")
        cached = min(prompt, usage.integer("cached_input_tokens", 0))
        t_req = self.pending_t_req
        if t_req is None:
            t_req = self.last_input if self.last_input is not None else ts
        if self.calls and t_req < self.calls[-1].t_req:
            t_req = ts
        call = Call(t_req=min(t_req, ts), t_end=ts, prompt=prompt,
                    output=usage.integer("output_tokens", 0), cached=cached,
                    new=prompt - cached, tools=self.pending_tools)
        self.calls.append(call)
        if self.first_cached is None:
            self.first_cached = cached
        self.pending_tools = []
        self.pending_t_req = None

    def _human(self) -> None:
        if self.calls and self.pending_t_req is None:
            self.calls[-1].human = True


def _text(payload: Fields) -> str:
    if not payload.has("content"):
        return ""
    content = payload.raw("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                return str(block["text"])
    return ""


def read_rollout(file: Path, options: ImportOptions) -> ProgramTrace | None:
    """The program of one rollout; ``None`` if it made no LLM call."""
    state = _Rollout()
    name = os.fspath(file)
    for lineno, line in json_lines(file, options):
        try:
            kind = line.opt_text("type")
            if kind not in LINE_TYPES:
                raise TraceError(name, f"line {lineno}", f"unknown line type {kind!r}",
                                 SKIP_HINT)
            payload = line.child(line.raw("payload"), "payload")
            if kind == "session_meta":
                state.name = state.name or payload.opt_text("id")
                continue
            if kind not in ("response_item", "event_msg"):
                continue
            ts = parse_time(line)
            if kind == "response_item":
                state.item(payload, ts)
            else:
                state.event(payload, ts)
        except TraceError as exc:
            options.fail(exc)
    if not state.calls:
        return None
    stem = file.name.split(".jsonl")[0]
    return build_program(state.name or stem, name, state.calls, state.first_cached or 0,
                         provider=PROVIDER)
