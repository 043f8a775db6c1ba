"""MORI's canonical trace file: a :class:`TraceSet` as JSON Lines, optionally gzipped.

Layout (UTF-8, one JSON object per line; gzip-compressed iff the path ends in ``.gz``,
in any letter case):

* line 1, the header: ``{"format": "mori-trace", "version": 1, "name": <set name>}``;
* then one top-level program per line::

    {"name": str, "source": str, "shared_prefix_tokens": int,
     "steps": [{"prompt_tokens": int, "output_tokens": int, "gap_s": float,
                "gap_kind": "tool" | "human" | "subagent" | "end", "reuse_tokens": int,
                "subagents": [{"delay_s": float, "program": {...a program object...}}]}]}

  ``subagents`` is omitted when empty. On reading, ``source`` defaults to ``""``,
  ``shared_prefix_tokens`` and ``reuse_tokens`` to 0, ``subagents`` to none; unknown
  fields are ignored; blank lines after the header are skipped.

Writing then reading gives back an equal :class:`TraceSet` (floats are written with
``repr`` precision). Any problem reading raises
:class:`~mori.traces.errors.TraceError` naming the file, the line and the field path.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from mori.traces.errors import Fields, TraceError
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet

FORMAT = "mori-trace"
VERSION = 1
_GAP_KINDS = ", ".join(kind.value for kind in GapKind)


def write_traceset(ts: TraceSet, path: str | os.PathLike[str]) -> None:
    """Write ``ts`` to ``path`` in the canonical format (gzip iff it ends in ``.gz``).

    The output is deterministic (compact JSON, gzip header without time or file name).
    Raises :class:`TraceError` if a number is not finite (JSON cannot hold it); the file
    may then be left incomplete. I/O errors propagate as :class:`OSError`.
    """
    file = os.fspath(path)
    header = {"format": FORMAT, "version": VERSION, "name": ts.name}
    with _open_write(file) as out:
        out.write(_dump(header))
        for index, program in enumerate(ts.programs):
            try:
                line = _dump(_program_to_json(program))
            except ValueError as exc:
                raise TraceError(
                    file, f"programs[{index}] ({program.name!r})", f"cannot write: {exc}"
                ) from exc
            out.write(line)


def read_traceset(path: str | os.PathLike[str]) -> TraceSet:
    """Read a canonical trace file written by :func:`write_traceset` (or by hand).

    Raises :class:`TraceError` naming the file, line (and column or field path) when the
    file is unreadable, not gzip although named ``.gz``, not UTF-8 JSON Lines, lacks the
    header, has an unsupported version, or a program does not follow the layout.
    """
    file = os.fspath(path)
    name: str | None = None
    programs: list[ProgramTrace] = []
    lineno = 0  # the last line read whole
    opened = False
    try:
        with _open_read(file) as stream:
            opened = True
            for lineno, raw_line in enumerate(stream, 1):
                if name is not None and not raw_line.strip():
                    continue
                obj = _parse_line(file, lineno, raw_line)
                if name is None:
                    name = _check_header(Fields(obj, file, "", lineno))
                else:
                    programs.append(_program_from_json(Fields(obj, file, "", lineno)))
    except (OSError, EOFError, zlib.error) as exc:
        where = f"line {lineno + 1}" if opened else None
        hint = "is it really gzip-compressed?" if _is_gzip(file) else None
        raise TraceError(file, where, f"cannot read: {exc}", hint) from exc
    if name is None:
        raise TraceError(file, "line 1", "empty file", f"expected the header {_header_example()}")
    return TraceSet(name=name, programs=tuple(programs))


def _is_gzip(file: str) -> bool:
    return file.lower().endswith(".gz")


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8") + b"\n"


@contextmanager
def _open_write(file: str) -> Iterator[io.BufferedIOBase]:
    with open(file, "wb") as raw:
        if _is_gzip(file):
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                yield gz
        else:
            yield raw


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
    if version != VERSION:
        raise header.error(
            f"unsupported version {version}", "version", f"this reader knows version {VERSION}"
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
        if step.subagents:
            item["subagents"] = [
                {"delay_s": spawn.delay_s, "program": _program_to_json(spawn.program)}
                for spawn in step.subagents
            ]
        steps.append(item)
    return {
        "name": program.name,
        "source": program.source,
        "shared_prefix_tokens": program.shared_prefix_tokens,
        "steps": steps,
    }


def _program_from_json(obj: Fields) -> ProgramTrace:
    steps: list[Step] = []
    for index, raw in enumerate(obj.array("steps")):
        steps.append(_step_from_json(obj.child(raw, f"{obj.path('steps')}[{index}]")))
    return ProgramTrace(
        name=obj.text("name"),
        steps=tuple(steps),
        shared_prefix_tokens=obj.integer("shared_prefix_tokens", 0),
        source=obj.text("source", ""),
    )


def _step_from_json(obj: Fields) -> Step:
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
        program = _program_from_json(spawn.child(spawn.raw("program"), spawn.path("program")))
        spawns.append(SubagentSpawn(delay_s=delay, program=program))
    return Step(
        prompt_tokens=prompt,
        output_tokens=obj.integer("output_tokens"),
        gap_s=obj.number("gap_s"),
        gap_kind=kind,
        reuse_tokens=reuse,
        subagents=tuple(spawns),
    )
