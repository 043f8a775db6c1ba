"""MORI's canonical trace file: a :class:`TraceSet` as JSON Lines, optionally gzipped.

Layout (UTF-8, one JSON object per line; gzip-compressed iff the path ends in ``.gz``,
in any letter case):

* line 1, the header: ``{"format": "mori-trace", "version": 2, "name": <set name>}``;
* then one top-level program per line::

    {"name": str, "source": str, "shared_prefix_tokens": int, "block_size": int,
     "provider": "claude" | "codex",
     "steps": [{"prompt_tokens": int, "output_tokens": int, "gap_s": float,
                "gap_kind": "tool" | "human" | "subagent" | "end", "reuse_tokens": int,
                "new_tokens": int, "call_s": float, "tool_names": [str, ...],
                "block_hashes": [int, ...],
                "subagents": [{"delay_s": float, "program": {...a program object...}}]}]}

  A subagent is nested in the step of its parent that spawned it: its parent is the
  enclosing program, its spawn time ``delay_s`` seconds after the end of that step's
  response. Optional fields are omitted when unknown or empty: ``block_size`` (only with
  block hashes), ``provider`` (the recording agent; readers of older files see ``""``),
  ``new_tokens``, ``call_s``, ``tool_names``, ``block_hashes``,
  ``subagents``. On reading, ``source`` defaults to ``""``, ``shared_prefix_tokens`` and
  ``reuse_tokens`` to 0; unknown fields are ignored; blank lines after the header are
  skipped.

Written by ``mori serve --record`` (:mod:`mori.gateway.record`), and ignored by the
reader: program-level ``"recogniser"``, ``"agent"``, ``"session"``, ``"parent"`` (strings;
the last two omitted when none) and ``"arrival_s"`` (the program's first request, wall
seconds since the Unix epoch), and with ``--record-text`` a step-level ``"text"`` (the
prompt's new text). Such a file is appended to one program at a time, each line its own
gzip member when gzipped (concatenated members are one valid gzip stream).

Version history: version 1 had no ``new_tokens``, ``call_s``, ``tool_names``,
``block_hashes`` nor ``block_size``; a version 1 file is read as the same set with those
unknown. Version 2 is written.

Writing then reading gives back an equal :class:`TraceSet` (floats are written with
``repr`` precision). :class:`TraceWriter` writes programs one at a time (bounded memory);
:func:`iter_programs` reads them one at a time. Any problem reading raises
:class:`~mori.traces.errors.TraceError` naming the file, the line and the field path,
but for a *torn last line*, the mark a crash leaves on a file written line by line: it is
skipped with a note (:class:`TornLine`, logged as a warning unless ``on_torn`` is given)
and every line before it is read. A torn last line is, in a plain file, a last line
without its newline that is not valid JSON; in a gzipped file, a last gzip member that is
cut short (or undecodable, with no whole member after it) and holds at most one line,
begun at a line boundary. A bad line anywhere else, or a cut through a member of several
lines (a file written by :class:`TraceWriter` is one member), still raises.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import mmap
import os
import re
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import BinaryIO

from mori.traces.errors import Fields, TraceError
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet, block_hashes

FORMAT = "mori-trace"
VERSION = 2
READ_VERSIONS = (1, 2)
_GAP_KINDS = ", ".join(kind.value for kind in GapKind)
_CHUNK = 1 << 16  # compressed bytes read at a time
_MEMBER_START = b"\x1f\x8b\x08"  # a gzip member's magic and its (deflate) method

log = logging.getLogger("mori.traces")

#: adds fields the reader ignores to a program as encoded: called with each program (its
#: subagents included), its JSON object and that object's list of step objects
Annotate = Callable[[ProgramTrace, dict[str, object], list[dict[str, object]]], None]


@dataclass(frozen=True, slots=True)
class TornLine:
    """A torn last line that a reader skipped: the ``file``, the ``line`` number, the
    byte ``offset`` in the file where the torn part begins (the line, or in a gzipped file
    its gzip member; the file is whole up to there), and ``reason``."""

    file: str
    line: int
    offset: int
    reason: str

    def __str__(self) -> str:
        return (f"{self.file}: line {self.line}: torn last line skipped ({self.reason}); "
                "the file was cut while being written, every line before it was read")


#: what a reader does with a :class:`TornLine` (by default: log a warning)
OnTorn = Callable[[TornLine], None]


def _log_torn(torn: TornLine) -> None:
    log.warning("%s", torn)


def write_traceset(ts: TraceSet, path: str | os.PathLike[str]) -> None:
    """Write ``ts`` to ``path`` in the canonical format (gzip iff it ends in ``.gz``).

    The output is deterministic (compact JSON, gzip header without time or file name).
    Raises :class:`TraceError` if a number is not finite (JSON cannot hold it); the file
    may then be left incomplete. I/O errors propagate as :class:`OSError`.
    """
    write_programs(path, ts.name, ts.programs)


def write_programs(
    path: str | os.PathLike[str], name: str, programs: Iterable[ProgramTrace]
) -> int:
    """Write a set named ``name`` from an iterable of programs, one at a time; return how
    many were written. Same output and errors as :func:`write_traceset`."""
    with TraceWriter(path, name) as writer:
        for program in programs:
            writer.write(program)
        return writer.count


class TraceWriter:
    """Writes a canonical trace file one program at a time (nothing is kept in memory).

    ``with TraceWriter(path, name) as w: w.write(program)``; the header is written on
    opening. Programs are written in the order given.
    """

    def __init__(self, path: str | os.PathLike[str], name: str) -> None:
        self.file = os.fspath(path)
        self.count = 0
        self._raw = open(self.file, "wb")  # noqa: SIM115 -- closed in close()
        self._gz: gzip.GzipFile | None = None
        self._out: io.BufferedIOBase | gzip.GzipFile = self._raw
        if is_gzip_path(self.file):
            self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0)
            self._out = self._gz
        self._out.write(encode_header(name))

    def write(self, program: ProgramTrace) -> None:
        """Append one top-level program (with its subagents)."""
        try:
            line = encode_program(program)
        except ValueError as exc:
            raise TraceError(
                self.file, f"programs[{self.count}] ({program.name!r})", f"cannot write: {exc}"
            ) from exc
        self._out.write(line)
        self.count += 1

    def close(self) -> None:
        """Finish the file (idempotent)."""
        if self._gz is not None:
            self._gz.close()
            self._gz = None
        self._raw.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def encode_header(name: str) -> bytes:
    """The header line of a set named ``name`` (UTF-8, newline included)."""
    return _dump({"format": FORMAT, "version": VERSION, "name": name})


def encode_program(program: ProgramTrace, annotate: Annotate | None = None) -> bytes:
    """The line of one top-level program (UTF-8, newline included). ``annotate`` may add
    fields to each program and step object (they must be fields the reader ignores).
    Raises :class:`ValueError` if a number is not finite."""
    return _dump(_program_to_json(program, annotate))


def is_gzip_path(file: str | os.PathLike[str]) -> bool:
    """Whether a trace file of this name is gzip-compressed (it ends in ``.gz``)."""
    return os.fspath(file).lower().endswith(".gz")


def read_traceset(path: str | os.PathLike[str], hashes: bool = True,
                  on_torn: OnTorn | None = None) -> TraceSet:
    """Read a canonical trace file written by :func:`write_traceset` (or by hand).

    ``hashes=False`` leaves the steps' block hashes (and the programs' ``block_size``)
    out, unread: a run or the statistics do not need them, and they are most of such a
    file's memory. A torn last line (see the module doc) is skipped and passed to
    ``on_torn`` (default: logged as a warning).

    Raises :class:`TraceError` naming the file, line (and column or field path) when the
    file is unreadable, not gzip although named ``.gz``, not UTF-8 JSON Lines, lacks the
    header, has an unsupported version, or a program does not follow the layout.
    """
    name, programs = read_header_and_programs(path, hashes, on_torn)
    return TraceSet(name=name, programs=tuple(programs))


def read_header_and_programs(path: str | os.PathLike[str], hashes: bool = True,
                             on_torn: OnTorn | None = None
                             ) -> tuple[str, Iterator[ProgramTrace]]:
    """The set name and an iterator over its programs, read lazily one line at a time.

    The header is checked before returning; program lines are parsed as the iterator is
    consumed (errors and torn lines as for :func:`read_traceset`). The file stays open
    until the iterator is exhausted or closed.
    """
    file = os.fspath(path)
    lines = _iter_objects(file, hashes, on_torn or _log_torn)
    first = next(lines, None)
    if first is None:
        raise TraceError(file, "line 1", "empty file", f"expected the header {_header_example()}")
    name = _check_header(Fields(first[1], file, "", first[0]))

    def programs() -> Iterator[ProgramTrace]:
        for lineno, obj in lines:
            yield _program_from_json(Fields(obj, file, "", lineno), hashes)

    return name, programs()


def iter_programs(path: str | os.PathLike[str], on_torn: OnTorn | None = None
                  ) -> Iterator[ProgramTrace]:
    """The top-level programs of a canonical trace file, one at a time."""
    return read_header_and_programs(path, on_torn=on_torn)[1]


def complete_length(path: str | os.PathLike[str], on_torn: OnTorn | None = None) -> int:
    """How many leading bytes of a canonical trace file are whole: its size, or the
    offset where its torn last line begins (where a writer that appends must cut it).

    Reads the whole file (every program is checked, block hashes skipped), so raises
    :class:`TraceError` as :func:`read_traceset` does for a file that is not a readable
    MORI trace; the torn line is passed to ``on_torn`` (default: logged as a warning).
    """
    file = os.fspath(path)
    torn: list[TornLine] = []

    def note(line: TornLine) -> None:
        torn.append(line)
        (on_torn or _log_torn)(line)

    for _ in read_header_and_programs(file, hashes=False, on_torn=note)[1]:
        pass
    return torn[0].offset if torn else os.path.getsize(file)


# a "block_hashes" array of integers with the comma that separates it from its neighbour
_HASHES_FIELD = re.compile(rb'(,\s*)?"block_hashes"\s*:\s*\[[-0-9,\s]*\](\s*,)?')


def _without_hashes(raw_line: bytes) -> bytes:
    """The line with every integer ``block_hashes`` array cut out, before it is parsed:
    the ints of a long program's hashes are most of the memory its parse takes."""
    if b'"block_hashes"' not in raw_line:
        return raw_line
    return _HASHES_FIELD.sub(lambda m: b"," if m.group(1) and m.group(2) else b"", raw_line)


def _iter_objects(file: str, hashes: bool, on_torn: OnTorn) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) for each non-blank line (after the first: ``hashes``
    False leaves the steps' ``block_hashes`` arrays out); a torn last line is passed to
    ``on_torn`` instead."""
    lineno = 0  # the last line read whole
    offset = 0  # in a plain file, where line ``lineno + 1`` begins
    opened = False
    gzipped = is_gzip_path(file)
    try:
        with open(file, "rb") as raw:
            opened = True
            for lineno, raw_line in enumerate(_gzip_lines(raw) if gzipped else raw, 1):
                start, offset = offset, offset + len(raw_line)
                if lineno > 1 and not raw_line.strip():
                    continue
                if not hashes and lineno > 1:
                    raw_line = _without_hashes(raw_line)
                try:
                    obj = _parse_line(file, lineno, raw_line)
                except TraceError as exc:
                    if gzipped or lineno == 1 or raw_line.endswith(b"\n"):
                        raise
                    on_torn(TornLine(file, lineno, start, f"no newline, {exc.problem}"))
                    return
                yield lineno, obj
    except _TornMember as torn:
        if lineno == 0:  # no whole header
            raise TraceError(file, "line 1", f"cannot read: {torn}",
                             "is it really gzip-compressed?") from torn
        on_torn(TornLine(file, lineno + 1, torn.offset, str(torn)))
    except (OSError, EOFError, zlib.error) as exc:
        where = f"line {lineno + 1}" if opened else None
        hint = "is it really gzip-compressed?" if gzipped else None
        raise TraceError(file, where, f"cannot read: {exc}", hint) from exc


class _TornMember(Exception):
    """The gzip stream ends in a member that is cut short, or undecodable with no whole
    member after it; ``offset``: where that member begins in the file."""

    def __init__(self, reason: str, offset: int) -> None:
        super().__init__(reason)
        self.offset = offset


def _gzip_lines(raw: BinaryIO) -> Iterator[bytes]:
    """The lines of a gzip file of one or more members (the last one without its newline
    if it has none). A member's lines are held back until it ends while it holds at most
    one line, so that a torn last member of one line (what a crash leaves of a file
    written a line a member) yields nothing and raises :class:`_TornMember`; a cut through
    a member of more lines, or one that began inside a line, raises :class:`EOFError`."""
    parts: list[bytes] = []  # the bytes of the line being read
    held: list[bytes] = []  # whole lines of the current member, not yet yielded
    several = False  # the current member holds more than one line: yield as read
    at_boundary = True  # the current member began at the start of a line
    try:
        for data, ended in _gzip_pieces(raw):
            if ended:
                yield from held
                held.clear()
                several, at_boundary = False, not parts
                continue
            pieces = data.split(b"\n")
            for piece in pieces[:-1]:
                parts.append(piece)
                held.append(b"".join(parts) + b"\n")
                parts.clear()
            if pieces[-1]:
                parts.append(pieces[-1])
            several = several or len(held) > 1 or (bool(held) and bool(parts))
            if several:
                yield from held
                held.clear()
    except _TornMember as torn:
        if several or not at_boundary:
            raise EOFError(f"{torn} (within a member of several lines)") from torn
        raise
    if parts:
        yield b"".join(parts)


def _gzip_pieces(raw: BinaryIO) -> Iterator[tuple[bytes, bool]]:
    """The decompressed data of a file of concatenated gzip members, in pieces: each
    ``(data, False)``, and ``(b"", True)`` where a member ends. Zero bytes between members
    are skipped (as :mod:`gzip` does). Raises :class:`_TornMember` where the file ends
    inside a member, or a member cannot be decoded and no whole member follows it, and
    :class:`zlib.error` where one does."""
    offset = 0  # the file offset of ``buf[0]``
    buf = raw.read(_CHUNK)
    while True:
        while not (stripped := buf.lstrip(b"\0")):
            offset += len(buf)
            buf = raw.read(_CHUNK)
            if not buf:
                return
        offset += len(buf) - len(stripped)
        buf, start = stripped, offset
        member = zlib.decompressobj(wbits=31)
        while not member.eof:
            if not buf and not (buf := raw.read(_CHUNK)):
                raise _TornMember("the file ends inside a gzip member", start)
            try:
                data = member.decompress(buf)
            except zlib.error as exc:
                if _whole_member_after(raw, start):
                    raise
                raise _TornMember(f"undecodable last gzip member: {exc}", start) from exc
            offset += len(buf) - len(member.unused_data)
            buf = member.unused_data
            if data:
                yield data, False
        yield b"", True


def _whole_member_after(raw: BinaryIO, start: int) -> bool:
    """Whether a gzip member that decodes to its end begins after offset ``start``."""
    with mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as view:
        at = view.find(_MEMBER_START, start + 1)
        while at >= 0:
            member = zlib.decompressobj(wbits=31)
            pos = at
            try:
                while not member.eof and pos < len(view):
                    member.decompress(view[pos:pos + _CHUNK])
                    pos += _CHUNK
            except zlib.error:
                pass
            if member.eof:
                return True
            at = view.find(_MEMBER_START, at + 1)
    return False


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"


def _header_example() -> str:
    return json.dumps({"format": FORMAT, "version": VERSION, "name": "..."})


def _parse_line(file: str, lineno: int, raw_line: bytes) -> object:
    try:
        text = raw_line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(file, f"line {lineno}", f"not UTF-8: {exc.reason}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {lineno}, column {exc.colno}"
        hint = f"the first line must be the header {_header_example()}" if lineno == 1 else None
        raise TraceError(file, where, f"invalid JSON: {exc.msg}", hint) from exc


def _check_header(header: Fields) -> str:
    hint = f"a MORI trace file starts with {_header_example()}"
    if not header.has("format") or header.text("format") != FORMAT:
        raise header.error(f"not a header: 'format' must be {FORMAT!r}", hint=hint)
    version = header.integer("version")
    if version not in READ_VERSIONS:
        known = " and ".join(str(v) for v in READ_VERSIONS)
        raise header.error(
            f"unsupported version {version}", "version", f"this reader knows versions {known}"
        )
    return header.text("name")


def _program_to_json(program: ProgramTrace, annotate: Annotate | None = None
                     ) -> dict[str, object]:
    steps: list[dict[str, object]] = []
    for step in program.steps:
        item: dict[str, object] = {
            "prompt_tokens": step.prompt_tokens,
            "output_tokens": step.output_tokens,
            "gap_s": step.gap_s,
            "gap_kind": GapKind(step.gap_kind).value,
            "reuse_tokens": step.reuse_tokens,
        }
        if step.new_tokens is not None:
            item["new_tokens"] = step.new_tokens
        if step.call_s is not None:
            item["call_s"] = step.call_s
        if step.tool_names:
            item["tool_names"] = list(step.tool_names)
        if step.block_hashes is not None:
            item["block_hashes"] = list(step.block_hashes)
        if step.subagents:
            item["subagents"] = [
                {"delay_s": spawn.delay_s,
                 "program": _program_to_json(spawn.program, annotate)}
                for spawn in step.subagents
            ]
        steps.append(item)
    out: dict[str, object] = {
        "name": program.name,
        "source": program.source,
        "shared_prefix_tokens": program.shared_prefix_tokens,
    }
    if program.block_size is not None:
        out["block_size"] = program.block_size
    if program.provider:
        out["provider"] = program.provider
    out["steps"] = steps
    if annotate is not None:
        annotate(program, out, steps)
    return out


def _program_from_json(obj: Fields, hashes: bool = True) -> ProgramTrace:
    steps: list[Step] = []
    for index, raw in enumerate(obj.array("steps")):
        steps.append(_step_from_json(obj.child(raw, f"{obj.path('steps')}[{index}]"), hashes))
    return ProgramTrace(
        name=obj.text("name"),
        steps=tuple(steps),
        shared_prefix_tokens=obj.integer("shared_prefix_tokens", 0),
        source=obj.text("source", ""),
        block_size=obj.integer("block_size") if hashes and obj.has("block_size") else None,
        provider=obj.text("provider", ""),
    )


def _step_from_json(obj: Fields, hashes: bool = True) -> Step:
    prompt = obj.integer("prompt_tokens")
    kind_text = obj.text("gap_kind")
    try:
        kind = GapKind(kind_text)
    except ValueError:
        raise obj.error(
            f"unknown gap kind {kind_text!r}", "gap_kind", f"expected one of: {_GAP_KINDS}"
        ) from None
    reuse = obj.integer("reuse_tokens", 0)
    if reuse > prompt:
        raise obj.error(
            f"reuse_tokens {reuse} exceeds prompt_tokens {prompt}",
            "reuse_tokens",
            "reuse counts leading prompt tokens, so it is at most prompt_tokens",
        )
    spawns: list[SubagentSpawn] = []
    for index, raw in enumerate(obj.array("subagents", [])):
        spawn = obj.child(raw, f"{obj.path('subagents')}[{index}]")
        delay = spawn.number("delay_s")
        program = _program_from_json(spawn.child(spawn.raw("program"), spawn.path("program")),
                                     hashes)
        spawns.append(SubagentSpawn(delay_s=delay, program=program))
    new = obj.integer("new_tokens") if obj.has("new_tokens") else None
    if new is not None and new > prompt:
        raise obj.error(
            f"new_tokens {new} exceeds prompt_tokens {prompt}",
            "new_tokens",
            "new tokens are part of the prompt, so at most prompt_tokens",
        )
    return Step(
        prompt_tokens=prompt,
        output_tokens=obj.integer("output_tokens"),
        gap_s=obj.number("gap_s"),
        gap_kind=kind,
        reuse_tokens=reuse,
        subagents=tuple(spawns),
        new_tokens=new,
        call_s=obj.opt_number("call_s"),
        tool_names=tuple(_strings(obj, "tool_names")),
        block_hashes=_hashes(obj) if hashes and obj.has("block_hashes") else None,
    )


def _strings(obj: Fields, key: str) -> list[str]:
    out: list[str] = []
    for index, value in enumerate(obj.array(key, [])):
        if not isinstance(value, str):
            raise obj.error(f"expected a string, got {type(value).__name__}", f"{key}[{index}]")
        out.append(value)
    return out


def _hashes(obj: Fields) -> Sequence[int]:
    values = obj.array("block_hashes")
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise obj.error(
                f"expected an integer, got {type(value).__name__}", f"block_hashes[{index}]"
            )
    return block_hashes(values)  # type: ignore[arg-type]
