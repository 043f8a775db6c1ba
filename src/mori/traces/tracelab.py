"""Importer for TraceLab round traces: Claude Code and Codex sessions, one row per LLM call.

TraceLab (github.com/uw-syfi/TraceLab; Zhu et al., arXiv 2606.30560; code Apache-2.0,
data CC BY 4.0) publishes its trace as normalized JSON Lines (``*.jsonl``, or gzipped)
and as a DuckDB database (``*.duckdb``, tables ``rounds``, ``tool_calls`` and
``timing_events``; the latter needs the ``duckdb`` package: ``pip install
'mori[tracelab]'``). A row (a *round*) is one LLM invocation:

* identity: ``provider`` (``claude`` / ``codex``), ``session_id``, ``round_index``,
  ``round_id``, ``model``, and bookkeeping fields read past (:data:`ROW_FIELDS`);
* tokens: ``input_tokens_total = prefix_tokens + newly_append_tokens``,
  ``output_tokens`` (reasoning included), Claude's own split (null for Codex);
* ``timing_events[]``: ordered ``{event_type, timestamp, source, ...}`` with types
  ``user_message`` and ``tool_result`` (inputs), ``reasoning``, ``text`` and
  ``tool_call`` (model output), and Codex's ``usage_report``;
* ``tools[]``: ``tool_name``, ``emitted_at``, ``result_at``, ``tool_wall_latency_ms``,
  ``tool_internal_latency_ms``, sizes and ``is_error``; sanitized public rows drop
  ``tools[].input``.

Rules (the timing rules proper are in :mod:`mori.traces.timeline`):

* One program per ``session_id``, named after it, its ``provider`` kept; its steps are
  its rounds in ``round_index`` order (file order among equal indexes; a row without an
  index keeps its place after the row before it). A repeated round (same session, index
  and ``round_id``) is left out and counted.
* ``prompt_tokens = input_tokens_total`` (``prefix + append`` when absent),
  ``reuse_tokens`` from ``prefix_tokens``, ``new_tokens = newly_append_tokens``,
  ``output_tokens = output_tokens``. ``shared_prefix_tokens``: the first round's prefix.
* A round's request is sent at the latest input event before its first model-output
  event, and its response ends at its last output or usage event (TraceLab's
  "observable generation time"). A round without any timestamp is placed at the end of
  the round before it (zero length; counted in a note).
* A tool runs from ``emitted_at`` for its effective latency: ``tool_internal_latency_ms``
  when present, else ``tool_wall_latency_ms``, else until ``result_at``.
* A person acted after a round when the next round's inputs hold a ``user_message``
  (TraceLab's human wait): that gap is ``HUMAN``; ``--human-gap cap|replace`` applies
  when simulating, as for every format.
* Subagents: private (unsanitized) Claude rows name a subagent's session
  ``<parent session>/subagents/agent-<id>``; such a program is nested in its parent,
  spawned at its first request, in the parent's call whose ``Task`` / ``Agent`` tool was
  running then (the parent waited on it: a ``SUBAGENT`` gap), else in the latest call
  begun before it (the gap keeps its kind). Sanitized rows pseudonymize session ids, so
  there every session is a top-level program.
* Tolerance: unknown row, tool or event fields and unknown event types are ignored and
  counted by name in the report; with ``strict`` they make the row bad. A row that is
  not a JSON object, lacks ``session_id`` or has a field of the wrong type is a bad line
  (:class:`~mori.traces.errors.TraceError` naming file and line; ``skip_bad`` skips it).

Streaming: a JSONL file is read twice, first only to count each session's rows, then to
build each program as soon as its last row (and its subagents' last rows) has been read;
memory holds the sessions open at a time, not the file (one session at a time when rows
are grouped by session, as TraceLab writes them). A database is read ordered by session.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mori.traces.errors import Fields, TraceError
from mori.traces.import_common import (
    ImportOptions,
    first_object,
    json_lines,
    open_binary,
    parse_time,
    walk_files,
)
from mori.traces.model import ProgramTrace
from mori.traces.timeline import Call, Spawn, ToolCall, build_program, span_s

FORMAT_NAME = "tracelab"
ROW_FIELDS = frozenset({
    "provider", "project", "session_id", "session_file", "round_index", "round_id",
    "turn_id", "model", "input_tokens_total", "prefix_tokens", "newly_append_tokens",
    "claude_uncached_input_tokens", "claude_cache_creation_input_tokens",
    "claude_cache_read_input_tokens", "output_tokens", "reasoning_output_tokens",
    "timing_events", "tools", "current_input_event_count", "current_user_message_count",
    "current_tool_result_count", "current_user_message_chars",
    "current_tool_result_chars", "current_input_chars", "first_input_event_type", "home",
    "user", "store", "trace_key", "cwd", "workdir",
})
TOOL_FIELDS = frozenset({
    "tool_index", "tool_name", "tool_call_id", "emitted_at", "result_at", "input",
    "input_chars", "result_chars", "tool_wall_latency_ms", "tool_internal_latency_ms",
    "is_error", "_assistant_uuid",
})
EVENT_FIELDS = frozenset({
    "event_type", "timestamp", "source", "content_chars", "tool_call_id", "tool_name",
    "tool_index", "result_chars", "is_error",
})
INPUT_EVENTS = frozenset({"user_message", "tool_result"})
OUTPUT_EVENTS = frozenset({"reasoning", "text", "tool_call"})
EVENT_TYPES = INPUT_EVENTS | OUTPUT_EVENTS | {"usage_report"}
WAITED_TOOLS = frozenset({"Task", "Agent"})
SUBAGENT_MARK = "/subagents/"
DB_SUFFIX = ".duckdb"
DUCKDB_HINT = "reading a TraceLab .duckdb file needs the duckdb package: pip install 'mori[tracelab]'"
DB_TABLES = ("rounds", "tool_calls", "timing_events")


@dataclass(slots=True)
class Round:
    """One row, reduced to what a step needs (times in POSIX seconds, ``None`` when the
    row has none)."""

    session: str
    index: int
    seq: int
    provider: str
    round_id: str | None
    t_req: float | None
    t_end: float | None
    user_input: bool
    prompt: int
    cached: int
    new: int
    output: int
    tools: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ToolRow:
    """A tool record's timing fields (seconds; ``None`` when absent)."""

    name: str
    emitted: float | None
    result: float | None
    wall_ms: float | None
    internal_ms: float | None


def round_times(events: Iterable[tuple[str, float | None]]) -> tuple[float | None, float | None, bool]:
    """(request time, response end, whether the inputs hold a ``user_message``) of a
    round from its ``(event type, timestamp)`` pairs in order (rules: module doc)."""
    t_req: float | None = None
    t_end: float | None = None
    first_ts: float | None = None
    user_input = False
    output_seen = False
    for kind, ts in events:
        if ts is not None and first_ts is None:
            first_ts = ts
        if kind in INPUT_EVENTS and not output_seen:
            user_input = user_input or kind == "user_message"
            if ts is not None:
                t_req = ts if t_req is None else max(t_req, ts)
        elif kind in OUTPUT_EVENTS or kind == "usage_report":
            output_seen = output_seen or kind in OUTPUT_EVENTS
            if ts is not None:
                t_end = ts if t_end is None else max(t_end, ts)
    if t_req is None:
        t_req = first_ts
    if t_end is None and t_req is not None:
        t_end = t_req
    return t_req, t_end, user_input


def tool_call(row: ToolRow, fallback_start: float | None) -> ToolCall | None:
    """The tool's run: from ``emitted_at`` (else ``fallback_start``) for the effective
    latency (internal, else wall, else until ``result_at``); ``None`` without any time."""
    start = row.emitted if row.emitted is not None else fallback_start
    if start is None:
        return None
    latency_ms = row.internal_ms if row.internal_ms is not None else row.wall_ms
    if latency_ms is not None:
        end: float | None = start + latency_ms / 1000.0
    elif row.result is not None:
        end = max(start, row.result)
    else:
        end = None
    return ToolCall(name=row.name, start=start, end=end)


# --- reading JSON Lines -------------------------------------------------------------


def _opt_time(obj: Fields, key: str) -> float | None:
    return parse_time(obj, key) if obj.has(key) else None


def _opt_ms(obj: Fields, key: str) -> float | None:
    return obj.number(key) if obj.has(key) else None


def _events(row: Fields, options: ImportOptions) -> list[tuple[str, float | None]]:
    out: list[tuple[str, float | None]] = []
    for index, raw in enumerate(row.array("timing_events", [])):
        event = row.child(raw, f"timing_events[{index}]")
        _check_fields(event, EVENT_FIELDS, options)
        kind = event.text("event_type")
        if kind not in EVENT_TYPES:
            options.unknown_part(event, f"event type {kind!r}", "event_type")
            continue
        out.append((kind, _opt_time(event, "timestamp")))
    return out


def _tools(row: Fields, options: ImportOptions) -> list[ToolRow]:
    out: list[ToolRow] = []
    for index, raw in enumerate(row.array("tools", [])):
        tool = row.child(raw, f"tools[{index}]")
        _check_fields(tool, TOOL_FIELDS, options)
        out.append(ToolRow(
            name=tool.text("tool_name", "?"),
            emitted=_opt_time(tool, "emitted_at"),
            result=_opt_time(tool, "result_at"),
            wall_ms=_opt_ms(tool, "tool_wall_latency_ms"),
            internal_ms=_opt_ms(tool, "tool_internal_latency_ms"),
        ))
    return out


def _check_fields(obj: Fields, known: frozenset[str], options: ImportOptions) -> None:
    for key in obj.field_names():
        if key not in known:
            options.unknown_part(obj, f"field {key!r}", key)


def _tokens(row: Fields) -> tuple[int, int, int, int]:
    """(prompt, cached, new, output) of a row."""
    cached = row.integer("prefix_tokens", row.integer("claude_cache_read_input_tokens", 0))
    if row.has("input_tokens_total"):
        prompt = row.integer("input_tokens_total")
    elif row.has("newly_append_tokens"):
        prompt = cached + row.integer("newly_append_tokens")
    else:
        prompt = row.integer("input_tokens_total")  # raises: missing field
    cached = min(cached, prompt)
    new = min(prompt, row.integer("newly_append_tokens", prompt - cached))
    return prompt, cached, new, row.integer("output_tokens", 0)


def round_from_json(row: Fields, seq: int, last_index: int, options: ImportOptions) -> Round:
    """The :class:`Round` of one JSONL row (``last_index``: the session's previous row's
    index, for a row without one); :class:`TraceError` if malformed."""
    _check_fields(row, ROW_FIELDS, options)
    session = row.text("session_id")
    index = row.integer("round_index", last_index)
    prompt, cached, new, output = _tokens(row)
    t_req, t_end, user_input = round_times(_events(row, options))
    rnd = Round(session=session, index=index, seq=seq, provider=row.text("provider", ""),
                round_id=row.opt_text("round_id"), t_req=t_req, t_end=t_end,
                user_input=user_input, prompt=prompt, cached=cached, new=new, output=output)
    rnd.tools = _tool_calls(_tools(row, options), t_end)
    return rnd


def _tool_calls(rows: Iterable[ToolRow], t_end: float | None) -> list[ToolCall]:
    return [call for row in rows if (call := tool_call(row, t_end)) is not None]


def _session_counts(file: Path) -> dict[str, int]:
    """Rows per ``session_id`` in a JSONL file (the first pass; bad lines are passed
    over here and judged in the second)."""
    counts: dict[str, int] = {}
    with open_binary(file) as stream:
        for raw in stream:
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except (ValueError, RecursionError):  # judged in the second pass
                continue
            session = value.get("session_id") if isinstance(value, dict) else None
            if isinstance(session, str):
                counts[session] = counts.get(session, 0) + 1
    return counts


def _jsonl_rounds(file: Path, options: ImportOptions,
                  expected: dict[str, int]) -> Iterator[Round | str]:
    """The rows of ``file`` as rounds, or, for a bad row whose session is known, that
    session's id (so the assembler stops waiting for it)."""
    last_index: dict[str, int] = {}
    for lineno, row in json_lines(file, options):
        session = row.peek("session_id")
        try:
            rnd = round_from_json(row, lineno, last_index.get(str(session), 0), options)
        except TraceError as exc:
            options.fail(exc)
            if isinstance(session, str) and session in expected:
                yield session
            continue
        last_index[rnd.session] = rnd.index
        yield rnd


# --- reading a DuckDB database ------------------------------------------------------

_DB_COUNTS = "SELECT session_id, count(*) FROM rounds GROUP BY session_id"
_DB_ROWS = """
WITH ev AS (
  SELECT round_pk,
         list(struct_pack(k := event_type,
                          t := CAST(epoch_us("timestamp") AS BIGINT)) ORDER BY event_index) AS events
  FROM timing_events GROUP BY round_pk),
tl AS (
  SELECT round_pk,
         list(struct_pack(name := tool_name,
                          emitted := CAST(epoch_us(emitted_at) AS BIGINT),
                          result := CAST(epoch_us(result_at) AS BIGINT),
                          wall := tool_wall_latency_ms,
                          internal := tool_internal_latency_ms) ORDER BY tool_index) AS tools
  FROM tool_calls GROUP BY round_pk)
SELECT r.round_pk, r.session_id, r.round_index, r.provider, r.round_id,
       r.input_tokens_total, r.prefix_tokens, r.newly_append_tokens, r.output_tokens,
       ev.events, tl.tools
FROM rounds r LEFT JOIN ev ON ev.round_pk = r.round_pk LEFT JOIN tl ON tl.round_pk = r.round_pk
WHERE r.session_id IS NOT NULL
ORDER BY r.session_id, r.round_index NULLS LAST, r.round_pk
"""
_BATCH = 4096


def _seconds(us: object) -> float | None:
    return None if us is None else float(us) / 1e6  # type: ignore[arg-type]


def _connect(file: Path) -> Any:
    try:
        import duckdb
    except ImportError:
        raise TraceError(file, None, "the duckdb package is not installed", DUCKDB_HINT) from None
    try:
        con = duckdb.connect(os.fspath(file), read_only=True)
    except duckdb.Error as exc:
        raise TraceError(file, None, f"cannot open as a DuckDB database: {exc}") from None
    names = {row[0] for row in con.execute(
        "SELECT table_name FROM information_schema.tables").fetchall()}
    missing = [t for t in DB_TABLES if t not in names]
    if missing:
        con.close()
        raise TraceError(file, None, f"not a TraceLab database: no table {missing[0]!r}",
                         "expected the tables " + ", ".join(DB_TABLES)
                         + " (TraceLab's syfi_coding_trace.duckdb)")
    return con


def _db_round(file: Path, row: tuple[Any, ...], last_index: int) -> Round:
    (pk, session, index, provider, round_id, total, prefix, append, output,
     events, tools) = row
    where = f"rounds row {pk}"
    if total is None and append is None:
        raise TraceError(file, where, "input_tokens_total and newly_append_tokens are null")
    cached = int(prefix or 0)
    prompt = int(total) if total is not None else cached + int(append)
    cached = min(cached, prompt)
    new = min(prompt, int(append) if append is not None else prompt - cached)
    if min(prompt, new, int(output or 0)) < 0:
        raise TraceError(file, where, "negative token count")
    t_req, t_end, user_input = round_times(
        (str(e["k"]), _seconds(e["t"])) for e in (events or []))
    rnd = Round(session=str(session), index=int(index) if index is not None else last_index,
                seq=int(pk), provider=str(provider or ""), round_id=round_id, t_req=t_req,
                t_end=t_end, user_input=user_input, prompt=prompt, cached=cached, new=new,
                output=int(output or 0))
    rnd.tools = _tool_calls(
        (ToolRow(name=str(t["name"] or "?"), emitted=_seconds(t["emitted"]),
                 result=_seconds(t["result"]),
                 wall_ms=None if t["wall"] is None else float(t["wall"]),
                 internal_ms=None if t["internal"] is None else float(t["internal"]))
         for t in (tools or [])), t_end)
    return rnd


def _db_read(file: Path, options: ImportOptions) -> tuple[dict[str, int], Iterator[Round | str]]:
    con = _connect(file)
    try:
        counts = {str(s): int(n) for s, n in con.execute(_DB_COUNTS).fetchall() if s is not None}
        cursor = con.execute(_DB_ROWS)
    except Exception as exc:  # duckdb.Error: a column missing or of another type
        con.close()
        raise TraceError(file, None, f"cannot read the TraceLab tables: {exc}",
                         "expected TraceLab's schema (artifacts/utils/DB_SCHEMA.md)") from None
    options.report.files += 1

    def rows() -> Iterator[Round | str]:
        last: dict[str, int] = {}
        try:
            while batch := cursor.fetchmany(_BATCH):
                for row in batch:
                    options.report.lines += 1
                    try:
                        rnd = _db_round(file, row, last.get(str(row[1]), 0))
                    except TraceError as exc:
                        options.fail(exc)
                        yield str(row[1])
                        continue
                    last[rnd.session] = rnd.index
                    yield rnd
        finally:
            con.close()

    return counts, rows()


# --- from rounds to programs --------------------------------------------------------


def parent_of(session: str) -> str | None:
    """The parent session id of a subagent's session id, or ``None``."""
    head, mark, _ = session.partition(SUBAGENT_MARK)
    return head if mark and head else None


@dataclass(slots=True)
class _Session:
    remaining: int
    rounds: list[Round] = field(default_factory=list)
    calls: list[Call] | None = None  # built when its rows are all read
    children: set[str] = field(default_factory=set)
    done_children: list[tuple[str, list[Call]]] = field(default_factory=list)
    provider: str = ""


class _Assembler:
    """Collects rounds by session and yields each top-level program once it and its
    subagents are complete (module doc: Streaming)."""

    def __init__(self, counts: dict[str, int], source: str, options: ImportOptions) -> None:
        self.source = source
        self.options = options
        self.sessions = {s: _Session(n) for s, n in counts.items()}
        self.parent: dict[str, str] = {}
        for session in counts:
            parent = parent_of(session)
            if parent is not None and parent in self.sessions:
                self.parent[session] = parent
                self.sessions[parent].children.add(session)
        self.duplicates = 0
        self.untimed = 0

    def feed(self, item: Round | str) -> Iterator[ProgramTrace]:
        session = item if isinstance(item, str) else item.session
        state = self.sessions.get(session)
        if state is None:  # a row the first pass did not count: wait for the end
            state = self.sessions[session] = _Session(1 << 62)
        if not isinstance(item, str):
            state.rounds.append(item)
        state.remaining -= 1
        if state.remaining == 0:
            yield from self._complete(session)

    def finish(self) -> Iterator[ProgramTrace]:
        """At the end of the input: complete the sessions whose rows fell short of the
        first pass's count (bad rows skipped), then report what was left out."""
        for session in [s for s, st in self.sessions.items() if st.calls is None]:
            if session in self.sessions:
                yield from self._complete(session)
        if self.duplicates:
            self.options.report.notes.append(
                f"{self.source}: {self.duplicates} repeated round(s) (same session, index "
                "and round_id) left out")
        if self.untimed:
            self.options.report.notes.append(
                f"{self.source}: {self.untimed} round(s) without any timestamp placed at the "
                "end of the round before them")

    def _complete(self, session: str) -> Iterator[ProgramTrace]:
        state = self.sessions[session]
        state.calls = self._calls(state)
        state.rounds = []
        state.remaining = 0
        parent = self.parent.get(session)
        if parent is not None and parent in self.sessions:
            yield from self._child_done(parent, session, state.calls)
            return
        yield from self._ready(session)

    def _child_done(self, parent: str, child: str, calls: list[Call]) -> Iterator[ProgramTrace]:
        del self.sessions[child]
        state = self.sessions[parent]
        state.children.discard(child)
        if calls:
            state.done_children.append((child, calls))
        else:
            self.options.report.empty_sessions += 1
        if state.calls is not None:
            yield from self._ready(parent)

    def _ready(self, session: str) -> Iterator[ProgramTrace]:
        state = self.sessions[session]
        if state.children or state.calls is None:
            return
        del self.sessions[session]
        calls = state.calls
        if not calls:
            self.options.report.empty_sessions += len(state.done_children) + 1
            return
        for child, child_calls in state.done_children:
            _link(calls, self._program(child, child_calls, state.provider), child_calls)
        program = self._program(session, calls, state.provider)
        everything = program.all_programs()
        self.options.report.programs += 1
        self.options.report.subagents += len(everything) - 1
        self.options.report.steps += sum(len(p.steps) for p in everything)
        yield program

    def _program(self, name: str, calls: list[Call], provider: str) -> ProgramTrace:
        return build_program(name, self.source, calls, calls[0].cached or 0, provider=provider)

    def _calls(self, state: _Session) -> list[Call]:
        rounds = sorted(state.rounds, key=lambda r: (r.index, r.seq))
        kept: list[Round] = []
        seen: set[tuple[int, str]] = set()
        for rnd in rounds:
            if rnd.round_id is not None:
                key = (rnd.index, rnd.round_id)
                if key in seen:
                    self.duplicates += 1
                    continue
                seen.add(key)
            kept.append(rnd)
        if kept:
            state.provider = next((r.provider for r in kept if r.provider), "")
        calls: list[Call] = []
        for position, rnd in enumerate(kept):
            previous_end = calls[-1].t_end if calls else 0.0
            t_req, t_end = rnd.t_req, rnd.t_end
            if t_req is None or t_end is None:
                self.untimed += 1
                t_req = t_end = previous_end
            calls.append(Call(t_req=t_req, t_end=max(t_req, t_end), prompt=rnd.prompt,
                              output=rnd.output, cached=rnd.cached, new=rnd.new,
                              tools=rnd.tools))
            if position > 0 and rnd.user_input:
                calls[-2].human = True
        return calls


def _link(parent: list[Call], program: ProgramTrace, calls: list[Call]) -> None:
    """Nest a subagent's program in the parent call it belongs to (module doc)."""
    start = calls[0].t_req
    for call in parent:
        if any(t.name in WAITED_TOOLS and t.start <= start and (t.end is None or start <= t.end)
               for t in call.tools):
            call.spawns.append(Spawn(start, program, span_s(calls), waited=True))
            return
    index = max((i for i, c in enumerate(parent) if c.t_req <= start), default=0)
    parent[index].spawns.append(Spawn(start, program, span_s(calls), waited=False))


# --- the importer -------------------------------------------------------------------


def _is_input_file(path: Path) -> bool:
    return path.name.lower().endswith((".jsonl", ".jsonl.gz", DB_SUFFIX))


def trace_files(paths: Sequence[Path]) -> list[Path]:
    """The TraceLab files under ``paths``: files as given, ``*.jsonl[.gz]`` and
    ``*.duckdb`` in directories (recursively, sorted)."""
    return walk_files(list(paths), _is_input_file)


def _looks_like_row(obj: dict[str, object] | None) -> bool:
    return (obj is not None and isinstance(obj.get("session_id"), str)
            and "round_index" in obj and ("input_tokens_total" in obj or "timing_events" in obj))


def looks_like_tracelab(path: Path) -> bool:
    """Whether ``path`` (a file, or a folder's first trace file) reads as TraceLab: a
    ``.duckdb`` file, or JSON Lines whose first object has ``session_id``,
    ``round_index`` and ``input_tokens_total`` or ``timing_events``."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _is_input_file(p))[:1]
    else:
        files = [path]
    for file in files:
        if file.name.lower().endswith(DB_SUFFIX):
            return True
        return _looks_like_row(first_object(file, max_lines=1))
    return False


def iter_programs(paths: Sequence[Path], options: ImportOptions) -> Iterator[ProgramTrace]:
    """One program per session under ``paths`` (rules: module doc), streamed."""
    for file in trace_files(paths):
        if file.name.lower().endswith(DB_SUFFIX):
            counts, rounds = _db_read(file, options)
            if options.progress is not None:
                options.progress(file.stat().st_size)
        else:
            counts = _session_counts(file)
            rounds = _jsonl_rounds(file, options, counts)
        assembler = _Assembler(counts, os.fspath(file), options)
        for item in rounds:
            yield from assembler.feed(item)
        yield from assembler.finish()

