"""Recording the programs the gateway serves as a canonical trace (``mori serve --record``).

:class:`TraceRecorder` collects each program's steps (:class:`StepRecord`: wall-clock
times and token counts as the gateway saw them) and, when the program ends, appends it to
a canonical trace file (:mod:`mori.traces.jsonl`) as one line, with the fields that file
documents as "written by mori serve --record". The result is read by ``mori trace
stats`` and ``mori simulate --traces`` like any other trace.

From records to :class:`~mori.traces.model.Step` s (steps in arrival order; durations
rounded to the microsecond, never negative):

* ``call_s = ended - arrival``; ``gap_s`` = the next step's arrival - this step's end;
* ``gap_kind``: ``TOOL`` when the answer called tools, ``HUMAN`` when it ended in text and
  another step followed, ``END`` for the last step;
* ``reuse_tokens``: the engine's cached prompt tokens, capped by this prompt and the
  previous one (a prefix of the program's previous prompt, as the model defines it; 0 for
  the first step or when the engine did not say); ``new_tokens = prompt - cached`` (capped
  by the prompt) when it did;
* a subagent (a program started with a ``parent``) that ends while its parent is open is
  nested below the parent's step that was the latest to end before the subagent's first
  arrival: ``delay_s`` = its first arrival - that step's end; the step's kind becomes
  ``SUBAGENT`` and its gap the residual after the last of its subagents ends (the parent's
  next arrival - their latest end; 0 for the parent's last step). A subagent whose parent
  has ended, is unknown, or has no step that ended before it arrived is written as a
  top-level program of its own. Programs without steps are not written.

Prompt text (``keep_text``, ``mori serve --record-text``) is bounded: at most
``text_max_bytes`` (UTF-8) of one program's text is held and written; the step whose text
passes the bound keeps what fits followed by :data:`TEXT_CUT_MARKER`, and each later step
of the program has the marker alone. An open program thus holds at most that much text in
memory, whatever its client sends.

The file: when it exists it must be a MORI trace, checked on opening without reading it
through (a restart costs the same for a file of any length): its first line must be a
trace header and its last whole line a JSON object; anything else is refused with a
:class:`~mori.traces.errors.TraceError` naming it. (The lines between are not read:
``mori trace stats`` and the other readers check them.) Programs are appended after its
last whole line (a torn line a crash left, found from the end of the file, is cut off
first, with a warning); else it is created with its header. In a ``.gz`` file every line
is its own gzip member, so the last one is found from the end; a file compressed as one
stream by another tool is decompressed through once.

Each program's line is built, encoded, compressed, written and flushed to the operating
system by one writer thread when the program ends (in the order programs end), never on
the caller's thread (the gateway's event loop): :meth:`TraceRecorder.end` only hands the
program over. A crash of the gateway loses the programs still open and those not written
yet, and tears at most the last line (the readers skip a torn last line). Nothing is
synced to the disk. :meth:`TraceRecorder.close` waits for the writer.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import queue
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from mori.traces.errors import TraceError
from mori.traces.jsonl import (
    FORMAT,
    READ_VERSIONS,
    encode_header,
    encode_program,
    is_gzip_path,
)
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn

log = logging.getLogger("mori.gateway")

SOURCE = "mori serve"  # the recorded programs' ``source``
#: the trace's ``provider`` for each agent kind the gateway recognises
PROVIDERS = {"claude-code": "claude", "codex": "codex"}
_NAME_ENDINGS = (".jsonl", ".jsonl.gz")
DEFAULT_TEXT_MAX_BYTES = 1024 * 1024
TEXT_CUT_MARKER = "[... cut: over --record-text-max-bytes]"
"""Where a program's recorded text was cut (its bound reached): ends the text kept."""
_MEMBER_START = b"\x1f\x8b\x08"  # a gzip member's magic and its (deflate) method
_TAIL_WINDOW = 1 << 20  # bytes read from a file's end first, to find its last line
_HEAD_LIMIT = 1 << 20  # the most of a first line read to check the header


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One request of a program as the gateway served it.

    ``arrival`` / ``ended``: wall-clock seconds (Unix time) when the request arrived and
    when its answer ended; ``cached_tokens``: prompt tokens the engine served from its
    cache, if it said; ``tool_names``: the tools the answer called, in order (empty: it
    ended in text); ``text``: the prompt's new text (kept only with ``keep_text``).
    """

    arrival: float
    ended: float
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    tool_names: tuple[str, ...]
    text: str | None = None


@dataclass(slots=True)
class _Program:
    """A program being recorded: who it is, its steps so far, and its ended subagents."""

    program_id: str
    recogniser: str
    agent: str
    session: str | None
    parent: str | None
    steps: list[StepRecord] = field(default_factory=list)
    subagents: list[_Program] = field(default_factory=list)
    text_bytes: int = 0  # of its steps' text, kept so far (UTF-8)

    def ordered(self) -> list[StepRecord]:
        """The steps in arrival order."""
        return sorted(self.steps, key=lambda s: s.arrival)

    def first_arrival(self) -> float:
        return min(s.arrival for s in self.steps)

    def last_end(self) -> float:
        return max(s.ended for s in self.steps)


@dataclass(slots=True)
class _Built:
    """A program made into a trace: the trace (None: it had no steps), the records its
    programs came from (by the trace object's id, to annotate the line), and the
    subagents that could not be nested (they become top-level lines)."""

    trace: ProgramTrace | None
    records: dict[int, tuple[_Program, list[StepRecord]]]
    orphans: list[_Program]


class TraceRecorder:
    """Records programs into the canonical trace file ``path`` (see the module doc).

    ``name``: the set's name in the header of a new file; ``keep_text``: write each step's
    prompt text (``StepRecord.text``) as a step-level ``"text"``, at most
    ``text_max_bytes`` of it a program (cut with :data:`TEXT_CUT_MARKER`). Raises
    :class:`~mori.traces.errors.TraceError` naming the file if it exists and is not a
    readable MORI trace, or its name does not end in ``.jsonl`` / ``.jsonl.gz``; I/O
    errors propagate as :class:`OSError` from here; the writer thread logs its own (the
    line is lost, recording goes on). The ``at`` arguments are wall-clock seconds of the call; the trace's own times come
    from the step records. After :meth:`close`, calls are ignored.
    """

    def __init__(self, path: str | os.PathLike[str], *, name: str = "mori-serve",
                 keep_text: bool = False,
                 text_max_bytes: int = DEFAULT_TEXT_MAX_BYTES) -> None:
        if text_max_bytes < 0:
            raise ValueError(f"text_max_bytes must be >= 0 (got {text_max_bytes})")
        self.file = os.fspath(path)
        self.keep_text = keep_text
        self.text_max_bytes = text_max_bytes
        self.written = 0  # top-level program lines written (by the writer thread)
        self._gzip = is_gzip_path(self.file)
        self._open: dict[str, _Program] = {}
        self._out: BinaryIO | None = _open_for_append(self.file, name, self._gzip)
        self._queue: queue.SimpleQueue[_Program | _Flush | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="mori record",
                                        daemon=True)
        self._writer.start()

    def start(self, program_id: str, *, recogniser: str, agent: str, session: str | None,
              parent: str | None, at: float) -> None:
        """A new program (nothing happens for a program already open)."""
        if self._out is None or program_id in self._open:
            return
        self._open[program_id] = _Program(program_id, recogniser, agent, session, parent)

    def step(self, program_id: str, rec: StepRecord) -> None:
        """A step of ``program_id`` ended (a program not started is started, with
        recogniser and agent ``"unknown"``)."""
        if self._out is None:
            return
        program = self._open.get(program_id)
        if program is None:
            program = _Program(program_id, "unknown", "unknown", None, None)
            self._open[program_id] = program
        if rec.text is not None:
            if self.keep_text:
                text, program.text_bytes = _capped(rec.text, program.text_bytes,
                                                   self.text_max_bytes)
            else:
                text = None
            rec = dataclasses.replace(rec, text=text)
        program.steps.append(rec)

    def end(self, program_id: str, at: float) -> None:
        """The program was released (by its client, or idle): it is written, or held in
        its open parent's line when it is a subagent. Unknown ids are ignored."""
        program = self._open.pop(program_id, None)
        if program is None or self._out is None:
            return
        parent = self._open.get(program.parent) if program.parent is not None else None
        if parent is not None:
            parent.subagents.append(program)
        else:
            self._queue.put(program)  # the writer thread builds and writes it

    def flush(self) -> None:
        """Wait until every program ended so far is written."""
        if self._out is not None and self._writer.is_alive():
            done = threading.Event()
            self._queue.put(_Flush(done))
            done.wait()

    def close(self, at: float) -> None:
        """End every open program (subagents before their parents, so they nest), wait
        for the writer to write them, and close the file (idempotent)."""
        if self._out is None:
            return
        try:
            for program_id in _close_order(self._open):
                self.end(program_id, at)
        finally:
            self._queue.put(None)
            self._writer.join()
            self._out.close()
            self._out = None

    def _write_loop(self) -> None:
        """The writer thread: writes each program handed over, until ``None``."""
        while (program := self._queue.get()) is not None:
            if isinstance(program, _Flush):
                program.done.set()
                continue
            try:
                self._write(program)
            except Exception:  # recording must never take serving down
                log.exception("writing the recorded program %s to %s failed",
                              program.program_id[:200], self.file)

    def _write(self, program: _Program) -> None:
        """Write ``program`` as a top-level line (unless it has no steps), then any
        subagent of it that could not be nested."""
        assert self._out is not None
        built = _build(program)
        if built.trace is not None:
            def annotate(trace: ProgramTrace, obj: dict[str, object],
                         steps: list[dict[str, object]]) -> None:
                record, ordered = built.records[id(trace)]
                _annotate(record, ordered, obj, steps, self.keep_text)

            line = encode_program(built.trace, annotate)
            self._out.write(gzip.compress(line, 6, mtime=0) if self._gzip else line)
            self._out.flush()
            self.written += 1
        for orphan in built.orphans:
            self._write(orphan)


@dataclass(frozen=True, slots=True)
class _Flush:
    """Handed to the writer thread: set ``done`` once what came before is written."""

    done: threading.Event


def _capped(text: str, used: int, limit: int) -> tuple[str, int]:
    """``text`` as kept when ``used`` bytes of its program's text are kept already, at
    most ``limit`` in all: whole, or what fits followed by :data:`TEXT_CUT_MARKER`; and
    the bytes kept now in all (``limit`` once cut, so later steps keep the marker only).
    Costs in proportion to what is kept, not to ``text``."""
    if not text:
        return text, used
    room = limit - used
    if room <= 0:
        return TEXT_CUT_MARKER, limit
    head = text[:room]  # every character is at least one byte
    raw = head.encode("utf-8", "surrogatepass")
    if len(head) == len(text) and len(raw) <= room:
        return text, used + len(raw)
    kept = raw[:room].decode("utf-8", "ignore")  # a character cut in two is dropped
    return kept + TEXT_CUT_MARKER, limit


def check_record_file(path: str | os.PathLike[str]) -> None:
    """``TraceError`` naming ``path`` unless it can be recorded into (a new or empty file,
    or a MORI trace: its header and its last line checked); nothing is written."""
    _whole_length(os.fspath(path))


def _whole_length(file: str) -> int | None:
    """How many leading bytes of the trace ``file`` are whole (None: new or empty); a
    :class:`TraceError` naming it when it cannot be recorded into. Reads its first line
    and its end, not what lies between."""
    if not file.lower().endswith(_NAME_ENDINGS):
        raise TraceError(file, None, "cannot record into it: the name must end in .jsonl "
                         "or .jsonl.gz", "the trace readers tell a trace file by its name")
    if not os.path.exists(file) or os.path.getsize(file) == 0:
        return None
    hint = ("cannot record into it: --record appends only to a readable MORI trace "
            "file (name a new file to start one)")
    gzipped = is_gzip_path(file)
    try:
        with open(file, "rb") as f:
            _check_header(file, _first_line(f, gzipped))
            size = os.fstat(f.fileno()).st_size
            whole, last = _gzip_tail(f, size) if gzipped else _plain_tail(f, size)
    except TraceError as exc:
        raise TraceError(file, exc.where, exc.problem,
                         f"{exc.hint}; {hint}" if exc.hint else hint) from exc
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(file, None, f"cannot read: {exc}",
                         "is it really gzip-compressed?; " + hint if gzipped else hint
                         ) from exc
    if whole == 0:
        raise TraceError(file, "line 1", "the header is torn", hint)
    _check_last_line(file, last, hint)
    return whole


def _first_line(f: BinaryIO, gzipped: bool) -> bytes:
    """The file's first line (at most ``_HEAD_LIMIT`` bytes of it)."""
    if not gzipped:
        return f.readline(_HEAD_LIMIT)
    member = zlib.decompressobj(wbits=31)
    out = b""
    while b"\n" not in out and len(out) < _HEAD_LIMIT and not member.eof:
        data = f.read(1 << 16)
        if not data:
            break
        try:
            out += member.decompress(data, _HEAD_LIMIT - len(out))
        except zlib.error as exc:
            raise TraceError(f.name, "line 1", f"cannot read: {exc}",
                             "is it really gzip-compressed?") from exc
    return out.split(b"\n", 1)[0]


def _check_header(file: str, line: bytes) -> None:
    example = json.dumps({"format": FORMAT, "version": max(READ_VERSIONS), "name": "..."})
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(file, "line 1", f"invalid JSON: {exc}",
                         f"the first line must be the header {example}") from exc
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise TraceError(file, "line 1", f"not a header: 'format' must be {FORMAT!r}",
                         f"a MORI trace file starts with {example}")
    if obj.get("version") not in READ_VERSIONS:
        known = " and ".join(str(v) for v in READ_VERSIONS)
        raise TraceError(file, "line 1", f"unsupported version {obj.get('version')!r}",
                         f"this recorder appends to versions {known}")


def _check_last_line(file: str, last: bytes, hint: str) -> None:
    """The last whole line must be a JSON object (the header or a program)."""
    try:
        obj = json.loads(last)
    except (ValueError, UnicodeDecodeError) as exc:
        raise TraceError(file, "its last line", f"invalid JSON: {exc}", hint) from exc
    if not isinstance(obj, dict):
        raise TraceError(file, "its last line", "not a JSON object", hint)


def _plain_tail(f: BinaryIO, size: int) -> tuple[int, bytes]:
    """(whole length, its last whole line) of a plain trace file, read from its end (a
    window that grows until it holds the lines needed). What follows the last newline is
    a torn line, unless it is a JSON object (a writer that left out the last newline)."""
    window = _TAIL_WINDOW
    while True:
        start = max(0, size - window)
        f.seek(start)
        data = f.read(size - start)
        window *= 4
        if data.endswith(b"\n"):
            p = data.rfind(b"\n", 0, len(data) - 1)
            if p < 0 and start > 0:
                continue
            return size, data[p + 1:-1]
        q = data.rfind(b"\n")
        if q < 0 and start > 0:
            continue
        tail = data[q + 1:]
        if _is_object(tail):
            return size, tail
        if q < 0:
            return 0, b""
        p = data.rfind(b"\n", 0, q)
        if p < 0 and start > 0:
            continue
        return start + q + 1, data[p + 1:q]


def _is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, UnicodeDecodeError):
        return False


def _last_line(buf: bytes) -> bytes:
    """What ``buf`` holds of its last line (a final newline aside)."""
    return buf[buf.rfind(b"\n", 0, len(buf) - 1) + 1:]


def _member(data: bytes, at: int) -> tuple[bytes, int] | None:
    """The gzip member starting at ``data[at]``: (the last line of its data, where it
    ends in ``data``; -1 when ``data`` ends inside it); None: not a member there. Holds
    one line of the data at a time, however long the member."""
    member = zlib.decompressobj(wbits=31)
    tail = b""
    pos = at
    try:
        while pos < len(data) and not member.eof:
            piece = data[pos:pos + (1 << 20)]
            tail = _last_line(tail + member.decompress(piece))
            pos += len(piece)
    except zlib.error:
        return None
    if not member.eof:
        return tail, -1
    return tail, len(data) - len(member.unused_data)


def _gzip_tail(f: BinaryIO, size: int) -> tuple[int, bytes]:
    """(whole length, its last whole line) of a gzip trace file, a line a member, read
    from its end: the last member that decodes whole (its CRC checked) ends the file, or
    ends right before a member cut short, or a few bytes too short to be one (torn)."""
    window = _TAIL_WINDOW
    while True:
        start = max(0, size - window)
        f.seek(start)
        data = f.read(size - start)
        window *= 4
        end = len(data.rstrip(b"\0"))  # zero padding after the last member: skipped
        cuts: set[int] = set()  # where a member cut short by the file's end may begin
        at = data.rfind(_MEMBER_START, 0, end)
        while at >= 0:
            found = _member(data, at)
            if found is not None:
                last, stop = found
                if stop == -1:
                    cuts.add(at)
                elif stop == end:
                    return size, last.rstrip(b"\n")
                elif stop in cuts or end - stop < 10:  # 10: a gzip member's header
                    return start + stop, last.rstrip(b"\n")
            at = data.rfind(_MEMBER_START, 0, at)
        if start == 0:
            if 0 in cuts:
                return 0, b""
            raise TraceError(f.name, "its end", "cannot read: no whole gzip member ends it",
                             "is it really gzip-compressed?")


def _open_for_append(file: str, name: str, gzipped: bool) -> BinaryIO:
    """The file opened for appending: created with its header when new or empty, else
    checked (a MORI trace) and cut after its last whole line."""
    whole = _whole_length(file)
    if whole is None:
        out = open(file, "wb")  # noqa: SIM115 -- the recorder closes it
        header = encode_header(name)
        out.write(gzip.compress(header, mtime=0) if gzipped else header)
        out.flush()
        return out
    size = os.path.getsize(file)
    if whole < size:
        log.warning("%s: cutting off %d bytes of a torn last line (the file was cut while "
                    "being written) before appending", file, size - whole)
        os.truncate(file, whole)
    out = open(file, "ab")  # noqa: SIM115 -- the recorder closes it
    if not gzipped and not _ends_with_newline(file):
        out.write(b"\n")
    return out


def _ends_with_newline(file: str) -> bool:
    with open(file, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _close_order(open_programs: dict[str, _Program]) -> list[str]:
    """The open programs' ids, the deepest (the most open ancestors) first."""
    def depth(program_id: str) -> int:
        seen = {program_id}
        parent = open_programs[program_id].parent
        while parent is not None and parent in open_programs and parent not in seen:
            seen.add(parent)
            parent = open_programs[parent].parent
        return len(seen)

    return sorted(open_programs, key=depth, reverse=True)


def _build(program: _Program) -> _Built:
    """``program`` as a trace, its ended subagents nested where they can be."""
    ordered = program.ordered()
    built = _Built(None, {}, [])
    spawns: list[list[SubagentSpawn]] = [[] for _ in ordered]
    last_ends: list[float] = [0.0 for _ in ordered]
    for sub in program.subagents:
        inner = _build(sub)
        if inner.trace is None:  # no steps: its own subagents stand alone
            built.orphans.extend(inner.orphans)
            continue
        index = _spawning_step(ordered, sub.first_arrival())
        if index is None:  # written on its own (its orphans with it)
            built.orphans.append(sub)
            continue
        built.orphans.extend(inner.orphans)
        built.records.update(inner.records)
        delay = _duration(sub.first_arrival() - ordered[index].ended)
        spawns[index].append(SubagentSpawn(delay, inner.trace))
        last_ends[index] = max(last_ends[index], sub.last_end())
    if ordered:
        steps = tuple(_step(ordered, i, spawns[i], last_ends[i]) for i in range(len(ordered)))
        built.trace = ProgramTrace(name=program.program_id, steps=steps, source=SOURCE,
                                   provider=PROVIDERS.get(program.agent)
                                   or PROVIDERS.get(program.recogniser, ""))
        built.records[id(built.trace)] = (program, ordered)
    return built


def _spawning_step(ordered: Sequence[StepRecord], first_arrival: float) -> int | None:
    """The index of the step that was the latest to end at or before ``first_arrival``
    (None: none had)."""
    best: int | None = None
    for index, rec in enumerate(ordered):
        if rec.ended <= first_arrival and (best is None or rec.ended >= ordered[best].ended):
            best = index
    return best


def _step(ordered: Sequence[StepRecord], index: int, spawns: list[SubagentSpawn],
          subagents_end: float) -> Step:
    """Step ``index`` of a program's records (in arrival order), with its subagents."""
    rec = ordered[index]
    nxt = ordered[index + 1] if index + 1 < len(ordered) else None
    prompt = max(0, rec.prompt_tokens)
    if spawns:
        kind = GapKind.SUBAGENT
        gap = 0.0 if nxt is None else _duration(nxt.arrival - max(subagents_end, rec.ended))
    elif nxt is None:
        kind, gap = GapKind.END, 0.0
    else:
        kind = GapKind.TOOL if rec.tool_names else GapKind.HUMAN
        gap = _duration(nxt.arrival - rec.ended)
    cached = None if rec.cached_tokens is None else min(max(0, rec.cached_tokens), prompt)
    reuse = 0
    if index > 0 and cached is not None:
        reuse = min(cached, max(0, ordered[index - 1].prompt_tokens))
    return Step(
        prompt_tokens=prompt,
        output_tokens=max(0, rec.output_tokens),
        gap_s=gap,
        gap_kind=kind,
        reuse_tokens=reuse,
        subagents=tuple(sorted(spawns, key=lambda s: s.delay_s)),
        new_tokens=None if cached is None else prompt - cached,
        call_s=_duration(rec.ended - rec.arrival),
        tool_names=tuple(rec.tool_names),
    )


def _duration(seconds: float) -> float:
    """A duration as written: rounded to the microsecond, never negative."""
    return max(0.0, round(seconds, 6))


def _annotate(program: _Program, ordered: Sequence[StepRecord], obj: dict[str, object],
              steps: list[dict[str, object]], keep_text: bool) -> None:
    """Add the recorder's own fields to a program's JSON object and its steps'."""
    obj["recogniser"] = program.recogniser
    obj["agent"] = program.agent
    if program.session is not None:
        obj["session"] = program.session
    if program.parent is not None:
        obj["parent"] = program.parent
    obj["arrival_s"] = round(program.first_arrival(), 6)
    if keep_text:
        for rec, step in zip(ordered, steps, strict=True):
            if rec.text is not None:
                step["text"] = rec.text
