"""MORI's canonical trace file: a :class:`TraceSet` as JSON Lines, optionally gzipped.

Layout (UTF-8, one JSON object per line; gzip-compressed iff the path ends in ``.gz``,
in any letter case):

* line 1, the header: ``{"format": "mori-trace", "version": 2, "name": <set name>}``;
* then one top-level program per line::

    {"name": str, "source": str, "shared_prefix_tokens": int, "block_size": int,
     "steps": [{"prompt_tokens": int, "output_tokens": int, "gap_s": float,
                "gap_kind": "tool" | "human" | "subagent" | "end", "reuse_tokens": int,
                "new_tokens": int, "call_s": float, "tool_names": [str, ...],
                "block_hashes": [int, ...],
                "subagents": [{"delay_s": float, "program": {...a program object...}}]}]}

  A subagent is nested in the step of its parent that spawned it: its parent is the
  enclosing program, its spawn time ``delay_s`` seconds after the end of that step's
  response. Optional fields are omitted when unknown or empty: ``block_size`` (only with
  block hashes), ``new_tokens``, ``call_s``, ``tool_names``, ``block_hashes``,
  ``subagents``. On reading, ``source`` defaults to ``""``, ``shared_prefix_tokens`` and
  ``reuse_tokens`` to 0; unknown fields are ignored; blank lines after the header are
  skipped.

Version history: version 1 had no ``new_tokens``, ``call_s``, ``tool_names``,
``block_hashes`` nor ``block_size``; a version 1 file is read as the same set with those
unknown. Version 2 is written.

Writing then reading gives back an equal :class:`TraceSet` (floats are written with
``repr`` precision). :class:`TraceWriter` writes programs one at a time (bounded memory);
:func:`iter_programs` reads them one at a time. Any problem reading raises
:class:`~mori.traces.errors.TraceError` naming the file, the line and the field path.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from mori.traces.errors import Fields, TraceError
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet, block_hashes

FORMAT = "mori-trace"
VERSION = 2
READ_VERSIONS = (1, 2)
_GAP_KINDS = ", ".join(kind.value for kind in GapKind)


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
        if _is_gzip(self.file):
            self._gz = gzip.GzipFile(filename="", mode="wb", fileobj=self._raw, mtime=0)
            self._out = self._gz
        self._out.write(_dump({"format": FORMAT, "version": VERSION, "name": name}))

    def write(self, program: ProgramTrace) -> None:
        """Append one top-level program (with its subagents)."""
        try:
            line = _dump(_program_to_json(program))
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


def read_traceset(path: str | os.PathLike[str], hashes: bool = True) -> TraceSet:
    """Read a canonical trace file written by :func:`write_traceset` (or by hand).

    ``hashes=False`` leaves the steps' block hashes (and the programs' ``block_size``)
    out, unread: a run or the statistics do not need them, and they are most of such a
    file's memory.

    Raises :class:`TraceError` naming the file, line (and column or field path) when the
    file is unreadable, not gzip although named ``.gz``, not UTF-8 JSON Lines, lacks the
    header, has an unsupported version, or a program does not follow the layout.
    """
    name, programs = read_header_and_programs(path, hashes)
    return TraceSet(name=name, programs=tuple(programs))


def read_header_and_programs(path: str | os.PathLike[str], hashes: bool = True
                             ) -> tuple[str, Iterator[ProgramTrace]]:
    """The set name and an iterator over its programs, read lazily one line at a time.

    The header is checked before returning; program lines are parsed as the iterator is
    consumed (errors as for :func:`read_traceset`). The file stays open until the
    iterator is exhausted or closed.
    """
    file = os.fspath(path)
    lines = _iter_objects(file, hashes)
    first = next(lines, None)
    if first is None:
        raise TraceError(file, "line 1", "empty file", f"expected the header {_header_example()}")
    name = _check_header(Fields(first[1], file, "", first[0]))

    def programs() -> Iterator[ProgramTrace]:
        for lineno, obj in lines:
            yield _program_from_json(Fields(obj, file, "", lineno), hashes)

    return name, programs()


def iter_programs(path: str | os.PathLike[str]) -> Iterator[ProgramTrace]:
    """The top-level programs of a canonical trace file, one at a time."""
    return read_header_and_programs(path)[1]


# a "block_hashes" array of integers with the comma that separates it from its neighbour
_HASHES_FIELD = re.compile(rb'(,\s*)?"block_hashes"\s*:\s*\[[-0-9,\s]*\](\s*,)?')


def _without_hashes(raw_line: bytes) -> bytes:
    """The line with every integer ``block_hashes`` array cut out, before it is parsed:
    the ints of a long program's hashes are most of the memory its parse takes."""
    if b'"block_hashes"' not in raw_line:
        return raw_line
    return _HASHES_FIELD.sub(lambda m: b"," if m.group(1) and m.group(2) else b"", raw_line)


def _iter_objects(file: str, hashes: bool = True) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) for each non-blank line after the first (``hashes``
    False: with the steps' ``block_hashes`` arrays left out)."""
    lineno = 0  # the last line read whole
    opened = False
    try:
        with _open_read(file) as stream:
            opened = True
            for lineno, raw_line in enumerate(stream, 1):
                if lineno > 1 and not raw_line.strip():
                    continue
                if not hashes and lineno > 1:
                    raw_line = _without_hashes(raw_line)
                yield lineno, _parse_line(file, lineno, raw_line)
    except (OSError, EOFError, zlib.error) as exc:
        where = f"line {lineno + 1}" if opened else None
        hint = "is it really gzip-compressed?" if _is_gzip(file) else None
        raise TraceError(file, where, f"cannot read: {exc}", hint) from exc


def _is_gzip(file: str) -> bool:
    return file.lower().endswith(".gz")


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"


@contextmanager
def _open_read(file: str) -> Iterator[io.BufferedIOBase]:
    if _is_gzip(file):
        with gzip.open(file, "rb") as gz:
            yield gz
    else:
        with open(file, "rb") as raw:
            yield raw


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


def _program_to_json(program: ProgramTrace) -> dict[str, object]:
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
                {"delay_s": spawn.delay_s, "program": _program_to_json(spawn.program)}
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
    out["steps"] = steps
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
