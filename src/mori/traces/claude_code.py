"""Importer for Claude Code session transcripts (``~/.claude/projects/**/*.jsonl``).

A project folder holds one ``<session>.jsonl`` per session and, for sessions that ran
subagents, ``<session>/subagents/agent-<agentId>.jsonl`` (``agent-acompact-*`` files are
automatic or ``/compact`` context compactions). Each line is one JSON object with a
``type``: ``user`` / ``assistant`` lines carry ``timestamp``, ``isSidechain`` and the
``message``; ``progress``, ``system``, ``file-history-snapshot``, ``queue-operation``,
``summary`` and a few bookkeeping types are read past. Lines of any other type (newer
versions add some: ``mode``, ``permission-mode``, ``ai-title``, ``attachment``, ...)
are skipped and counted by type in the report, or, with ``ImportOptions.strict``, are
bad lines. A line that is not a JSON object, has no ``type``, or a user/assistant line
without its fields is a bad line (:class:`~mori.traces.errors.TraceError` naming file
and line; ``skip_bad`` skips it).

Rules (the timing rules proper are in :mod:`mori.traces.timeline`):

* One step per API response: the assistant lines that share a ``requestId`` are merged
  (one line per content block in Claude Code 2.1; they repeat the same ``usage``). A
  line without ``requestId`` (sanitised exports drop it) is grouped by its
  ``message.id`` instead. Synthetic messages (model ``<synthetic>``, or
  ``isApiErrorMessage``) and lines with neither id are not LLM calls.
* ``prompt_tokens = input + cache_creation_input + cache_read_input`` tokens;
  ``new_tokens = input + cache_creation``; ``reuse_tokens`` from ``cache_read``;
  ``output_tokens`` the largest ``output_tokens`` among the response's lines (early
  versions log a streaming value: a lower bound). ``tool_names``: the ``tool_use``
  blocks' names. ``shared_prefix_tokens``: the first call's ``cache_read`` (a cache hit
  on a session's first call can only be a prefix shared with other sessions: tools and
  system prompt).
* A request's time is the last user line before its first assistant line (the tool
  result or prompt that triggered it); its response ends at its last assistant line.
  A tool call runs from its ``tool_use`` line to the user line holding its
  ``tool_result``.
* A person acted in the gap after a response when a user line that is not a tool
  result, not ``isMeta`` and not a compaction summary follows it: a typed prompt, an
  interruption, a slash command. That gap is ``HUMAN``.
* Main chain: the session file's lines with ``isSidechain`` false (sidechain lines in a
  session file, written by old versions, are counted and left out). Each subagent file
  becomes a program named ``<session>/<agentId>`` spawned at its first line: linked to
  the parent call whose ``Task`` tool result names its ``agentId`` (the parent waits on
  it: a ``SUBAGENT`` gap), or, when no tool result names it (compactions), to the parent
  call in progress at its first line (the gap keeps its kind). A subagent with no file
  is rebuilt from the ``agent_progress`` lines that mirror its messages in the parent
  file, when there are some.
* A session without any LLM call is left out (counted). A subagent file whose session
  file is absent becomes a top-level program.
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
    first_objects,
    json_lines,
    parse_time,
    walk_files,
)
from mori.traces.model import ProgramTrace
from mori.traces.timeline import Call, Spawn, ToolCall, build_program, span_s

FORMAT_NAME = "claude-code"
PROVIDER = "claude"
CONVERSATION_TYPES = frozenset({"user", "assistant"})
IGNORED_TYPES = frozenset({
    "system", "progress", "file-history-snapshot", "queue-operation", "summary",
    "custom-title", "tag", "agent-name", "last-prompt", "pr-link",
})
COMPACTION_PREFIX = "acompact"
SYNTHETIC_MODEL = "<synthetic>"


def is_transcript_file(path: Path) -> bool:
    """Whether ``path`` is named like a transcript (``*.jsonl``, optionally gzipped)."""
    return path.name.lower().endswith((".jsonl", ".jsonl.gz"))


def looks_like_claude_code(path: Path) -> bool:
    """Whether ``path`` (a transcript file, or a folder holding one) reads as Claude Code:
    its first object of a known Claude Code line ``type`` has a ``sessionId``, ``uuid``
    or ``messageId``. Leading objects of other string types that carry a ``sessionId``
    (bookkeeping lines of newer versions, such as ``permission-mode``) are looked past;
    any other first object is not Claude Code."""
    files = [path] if path.is_file() else _first_files(path)
    for file in files:
        for obj in first_objects(file):
            kind = obj.get("type")
            if kind in CONVERSATION_TYPES or kind in IGNORED_TYPES:
                return any(key in obj for key in ("sessionId", "uuid", "messageId"))
            if not (isinstance(kind, str) and "sessionId" in obj):
                return False
    return False


def _first_files(directory: Path, limit: int = 3) -> list[Path]:
    out: list[Path] = []
    if not directory.is_dir():
        return out
    for p in sorted(directory.rglob("*.jsonl*")):
        if p.is_file() and is_transcript_file(p):
            out.append(p)
            if len(out) >= limit:
                break
    return out


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".JSONL.GZ", ".jsonl", ".JSONL"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _is_agent_file(path: Path) -> bool:
    return path.parent.name == "subagents" and _stem(path).startswith("agent-")


def session_files(paths: Sequence[Path]) -> list[Path]:
    """Every transcript file under ``paths`` (sessions and subagent files), sorted per
    folder."""
    return walk_files(list(paths), is_transcript_file)


def iter_programs(paths: Sequence[Path], options: ImportOptions) -> Iterator[ProgramTrace]:
    """One top-level program per session under ``paths`` (rules: module doc), streamed:
    each session is read, converted and yielded before the next is opened."""
    files = session_files(paths)
    sessions = [f for f in files if not _is_agent_file(f)]
    session_dirs = {f.parent / _stem(f) for f in sessions}
    for file in files:
        if _is_agent_file(file) and file.parent.parent not in session_dirs:
            program = _orphan_agent(file, options)
            if program is not None:
                options.report.notes.append(
                    f"{file}: subagent file without its session file; imported as a "
                    "top-level program")
                _count(program, options, top=True)
                yield program
            continue
        if _is_agent_file(file):
            continue  # read with its session
        program = read_session(file, options)
        if program is not None:
            _count(program, options, top=True)
            yield program


def _count(program: ProgramTrace, options: ImportOptions, top: bool) -> None:
    report = options.report
    everything = program.all_programs()
    report.programs += 1 if top else 0
    report.subagents += len(everything) - 1
    report.steps += sum(len(p.steps) for p in everything)


@dataclass(slots=True)
class _Chain:
    """The state of one conversation being read: its calls so far and what links them."""

    calls: list[Call] = field(default_factory=list)
    request_index: dict[str, int] = field(default_factory=dict)
    last_input: float | None = None
    open_tools: dict[str, tuple[ToolCall, int]] = field(default_factory=dict)
    agent_links: dict[str, int] = field(default_factory=dict)
    first_cached: int | None = None

    def assistant(self, line: Fields, ts: float) -> None:
        message = line.child(line.raw("message"), "message")
        request_id = _response_id(line, message)
        if request_id is None:
            return  # a synthetic message, not an API response
        usage = message.child(message.raw("usage"), "message.usage")
        output = usage.integer("output_tokens", 0)
        uses = _tool_uses(message)
        index = self.request_index.get(request_id)
        if index is None:
            fresh = usage.integer("input_tokens", 0)
            created = usage.integer("cache_creation_input_tokens", 0)
            read = usage.integer("cache_read_input_tokens", 0)
            t_req = ts
            if self.last_input is not None and (
                not self.calls or self.last_input >= self.calls[-1].t_req
            ):
                t_req = min(self.last_input, ts)
            index = len(self.calls)
            self.request_index[request_id] = index
            self.calls.append(Call(t_req=t_req, t_end=ts, prompt=fresh + created + read,
                                   output=output, cached=read, new=fresh + created))
            if self.first_cached is None:
                self.first_cached = read
        call = self.calls[index]
        call.t_end = max(call.t_end, ts)
        call.output = max(call.output, output)
        for tool_id, name in uses:
            tool = ToolCall(name=name, start=ts)
            call.tools.append(tool)
            self.open_tools[tool_id] = (tool, index)

    def user(self, line: Fields, ts: float) -> None:
        message = line.child(line.raw("message"), "message")
        content = message.raw("content") if message.has("content") else ""
        results: list[str] = []
        if isinstance(content, list):
            for i, block in enumerate(content):
                b = message.child(block, f"message.content[{i}]")
                if b.opt_text("type") == "tool_result":
                    results.append(b.text("tool_use_id"))
        elif not isinstance(content, str):
            raise message.error("expected a string or an array", "content", SKIP_HINT)
        agent_id = _agent_id(line)
        for tool_id in results:
            entry = self.open_tools.pop(tool_id, None)
            if entry is None:
                continue
            tool, index = entry
            tool.end = ts
            if agent_id is not None:
                self.agent_links.setdefault(agent_id, index)
                agent_id = None
        if (self.calls and not results and not _flag(line, "isMeta")
                and not _flag(line, "isCompactSummary")):
            self.calls[-1].human = True
        self.last_input = ts

    def progress_link(self, agent_id: str, tool_id: str | None) -> None:
        """A progress line says ``agent_id`` runs for tool call ``tool_id``."""
        if tool_id is not None and agent_id not in self.agent_links:
            entry = self.open_tools.get(tool_id)
            if entry is not None:
                self.agent_links[agent_id] = entry[1]


def _response_id(line: Fields, message: Fields) -> str | None:
    """The id grouping an assistant line with the others of its API response: its
    ``requestId``, else its ``message.id``; ``None`` for a synthetic message."""
    request_id = line.opt_text("requestId")
    if request_id is not None:
        return request_id
    if _flag(line, "isApiErrorMessage") or message.opt_text("model") == SYNTHETIC_MODEL:
        return None
    message_id = message.opt_text("id")
    return None if message_id is None else "message:" + message_id


def _flag(line: Fields, key: str) -> bool:
    return line.has(key) and line.raw(key) is True


def _agent_id(line: Fields) -> str | None:
    if not line.has("toolUseResult"):
        return None
    result = line.raw("toolUseResult")
    if isinstance(result, dict):
        value = result.get("agentId")
        if isinstance(value, str) and value:
            return value
    return None


def _tool_uses(message: Fields) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if not message.has("content"):
        return out
    content = message.raw("content")
    if not isinstance(content, list):
        return out
    for i, block in enumerate(content):
        b = message.child(block, f"message.content[{i}]")
        if b.opt_text("type") == "tool_use":
            out.append((b.text("id"), b.text("name", "?")))
    return out


@dataclass(slots=True)
class _FileRead:
    """A transcript file read: its main chain, the subagents mirrored in its progress
    lines, and how many sidechain lines it left out."""

    chain: _Chain
    mirrored: dict[str, _Chain]
    sidechain_lines: int = 0


def _read_file(file: Path, options: ImportOptions, whole: bool) -> _FileRead:
    """Read ``file``; ``whole``: every conversation line belongs to the chain (a subagent
    file), else only the non-sidechain ones."""
    out = _FileRead(_Chain(), {})
    for _, line in json_lines(file, options):
        try:
            kind = line.text("type")
            if kind in CONVERSATION_TYPES:
                if not whole and _flag(line, "isSidechain"):
                    out.sidechain_lines += 1
                    continue
                _dispatch(out.chain, kind, line, parse_time(line))
            elif kind == "progress":
                _progress(out, line)
            elif kind not in IGNORED_TYPES:
                options.unknown_type(line, kind)
        except TraceError as exc:
            options.fail(exc)
    return out


def _dispatch(chain: _Chain, kind: str | None, line: Fields, ts: float) -> None:
    if kind == "assistant":
        chain.assistant(line, ts)
    else:
        chain.user(line, ts)


def _progress(out: _FileRead, line: Fields) -> None:
    if not line.has("data"):
        return
    data = line.child(line.raw("data"), "data")
    if data.opt_text("type") != "agent_progress" or not data.has("message"):
        return
    agent_id = data.opt_text("agentId")
    if agent_id is None:
        return
    out.chain.progress_link(agent_id, line.opt_text("parentToolUseID"))
    inner = data.child(data.raw("message"), "data.message")
    kind = inner.opt_text("type")
    if kind not in CONVERSATION_TYPES:
        return
    ts = parse_time(inner) if inner.has("timestamp") else parse_time(line)
    chain = out.mirrored.setdefault(agent_id, _Chain())
    _dispatch(chain, kind, inner, ts)


def _program(name: str, file: Path, chain: _Chain) -> ProgramTrace:
    return build_program(name, os.fspath(file), chain.calls, chain.first_cached or 0,
                         provider=PROVIDER)


def read_session(file: Path, options: ImportOptions) -> ProgramTrace | None:
    """The program of one session file with its subagents linked; ``None`` (counted) if
    the session made no LLM call."""
    name = _stem(file)
    read = _read_file(file, options, whole=False)
    main = read.chain
    if read.sidechain_lines:
        options.report.notes.append(
            f"{file}: {read.sidechain_lines} sidechain line(s) in the session file left out")
    agents: dict[str, tuple[Path, _Chain]] = {}
    agents_dir = file.parent / name / "subagents"
    if agents_dir.is_dir():
        for agent_file in sorted(agents_dir.iterdir()):
            if not (agent_file.is_file() and is_transcript_file(agent_file)
                    and _stem(agent_file).startswith("agent-")):
                continue
            chain = _read_file(agent_file, options, whole=True).chain
            agents[_stem(agent_file)[len("agent-"):]] = (agent_file, chain)
    for agent_id, chain in read.mirrored.items():
        agents.setdefault(agent_id, (file, chain))
    if not main.calls:
        options.report.empty_sessions += 1
        return None
    for agent_id, (source, chain) in agents.items():
        if not chain.calls:
            options.report.empty_sessions += 1
            continue
        program = _program(f"{name}/{agent_id}", source, chain)
        start = chain.calls[0].t_req
        index = main.agent_links.get(agent_id)
        waited = index is not None and not agent_id.startswith(COMPACTION_PREFIX)
        if index is None:
            index = max((i for i, c in enumerate(main.calls) if c.t_req <= start), default=0)
        main.calls[index].spawns.append(Spawn(start, program, span_s(chain.calls), waited))
    return _program(name, file, main)


def _orphan_agent(file: Path, options: ImportOptions) -> ProgramTrace | None:
    chain = _read_file(file, options, whole=True).chain
    if not chain.calls:
        options.report.empty_sessions += 1
        return None
    return _program(f"{file.parent.parent.name}/{_stem(file)[len('agent-'):]}", file, chain)
