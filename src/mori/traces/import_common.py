"""What every importer shares: options, a report of what was read, and a streaming
reader of JSON Lines that names the file and line of any bad one.

Importers read line by line and never hold a whole file; a bad line (not JSON, not an
object, a field missing or of the wrong type) is a
:class:`~mori.traces.errors.TraceError` naming the file and line, unless
``ImportOptions.skip_bad`` is set: then it is skipped and counted in the report. A line
of a ``type`` the importer does not know (recorders add new ones) is skipped and counted
by type, unless ``ImportOptions.strict`` is set: then it is a bad line too.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, cast

from mori.traces.errors import Fields, TraceError

MAX_EXAMPLES = 5
SKIP_HINT = "--skip-bad skips such lines and counts them"
STRICT_HINT = "without --strict, lines of unknown types are skipped and counted"
STRICT_PART_HINT = "without --strict, unknown fields and event types are ignored and counted"


@dataclass(slots=True)
class ImportReport:
    """Counts of what an import read, kept, and skipped."""

    files: int = 0
    lines: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    programs: int = 0
    subagents: int = 0
    steps: int = 0
    empty_sessions: int = 0
    unknown_types: dict[str, int] = field(default_factory=dict)
    ignored: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def unknown(self, kind: str) -> None:
        """Count a skipped line of the unknown type ``kind``."""
        self.unknown_types[kind] = self.unknown_types.get(kind, 0) + 1

    def unknown_summary(self) -> str | None:
        """``"skipped 3 lines of unknown types: attachment 1, mode 2"`` (types sorted), or
        ``None`` when no line was skipped for its type."""
        if not self.unknown_types:
            return None
        total = sum(self.unknown_types.values())
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(self.unknown_types.items()))
        lines = "line" if total == 1 else "lines"
        types = "type" if len(self.unknown_types) == 1 else "types"
        return f"skipped {total} {lines} of unknown {types}: {counts}"

    def ignore(self, what: str) -> None:
        """Count an ignored unknown part of a line: ``"field 'x'"``, ``"event type 'y'"``."""
        self.ignored[what] = self.ignored.get(what, 0) + 1

    def ignored_summary(self) -> str | None:
        """``"ignored unknown parts: event type 'x' 2, field 'y' 5"`` (sorted), or ``None``."""
        if not self.ignored:
            return None
        counts = ", ".join(f"{what} {n}" for what, n in sorted(self.ignored.items()))
        return f"ignored unknown parts: {counts}"

    def bad(self, error: TraceError) -> None:
        """Count a skipped bad line (keeping the first few messages)."""
        self.bad_lines += 1
        if len(self.bad_examples) < MAX_EXAMPLES:
            self.bad_examples.append(str(error))

    def summary(self) -> str:
        """One line: files, lines, programs, subagents, steps, skips; then, after a
        semicolon, the lines skipped for their unknown type, by type."""
        parts = [
            f"{self.files} file(s)",
            f"{self.lines} line(s)",
            f"{self.programs} program(s)",
            f"{self.subagents} subagent(s)",
            f"{self.steps} step(s)",
        ]
        if self.empty_sessions:
            parts.append(f"{self.empty_sessions} session(s) without any LLM call left out")
        if self.bad_lines:
            parts.append(f"{self.bad_lines} bad line(s) skipped")
        extra = [x for x in (self.unknown_summary(), self.ignored_summary()) if x is not None]
        return "; ".join([", ".join(parts), *extra])


@dataclass(slots=True)
class ImportOptions:
    """How to import. ``skip_bad``: skip and count bad lines instead of failing;
    ``strict``: a line of an unknown type is a bad line (by default it is skipped and
    counted by type); ``keep_hashes``: keep block hashes where the format has them;
    ``progress``: called with the number of bytes consumed, as the import advances."""

    skip_bad: bool = False
    strict: bool = False
    keep_hashes: bool = True
    progress: Callable[[int], None] | None = None
    report: ImportReport = field(default_factory=ImportReport)

    def fail(self, error: TraceError) -> None:
        """Raise ``error``, or count it when skipping bad lines."""
        if not self.skip_bad:
            raise error
        self.report.bad(error)

    def unknown_type(self, line: Fields, kind: str) -> None:
        """A line of type ``kind`` that the importer does not know: counted, or (strict)
        a bad line naming its file and line."""
        if self.strict:
            self.fail(line.error(f"unknown line type {kind!r}", hint=STRICT_HINT))
        else:
            self.report.unknown(kind)

    def unknown_part(self, where: Fields, what: str, key: str | None = None) -> None:
        """An unknown part of a known line (``what``: ``"field 'x'"``, ``"event type
        'y'"``): counted, or (strict) a :class:`TraceError` raised at ``where`` (its field
        ``key`` when given), naming the file and line."""
        if self.strict:
            raise where.error(f"unknown {what}", key, STRICT_PART_HINT)
        self.report.ignore(what)


def open_binary(file: Path) -> IO[bytes]:
    """``file`` opened for reading bytes, decompressed when its name ends in ``.gz``."""
    if file.name.lower().endswith(".gz"):
        return cast(IO[bytes], gzip.open(file, "rb"))
    return open(file, "rb")  # noqa: SIM115 -- the caller closes it


def _decompressed(file: Path, disk: IO[bytes]) -> IO[bytes]:
    """The bytes of ``disk`` (``file`` opened), decompressed when its name ends in ``.gz``."""
    if file.name.lower().endswith(".gz"):
        return cast(IO[bytes], gzip.GzipFile(fileobj=disk, mode="rb"))
    return disk


def json_lines(file: Path, options: ImportOptions) -> Iterator[tuple[int, Fields]]:
    """(line number, the line's JSON object) for each non-blank line of ``file``.

    Lines that are not UTF-8 JSON objects go through ``options.fail``. An unreadable
    file is a :class:`TraceError` even when skipping bad lines.
    """
    name = os.fspath(file)
    report = options.report
    report.files += 1
    lineno = 0
    try:
        with open(file, "rb") as disk, _decompressed(file, disk) as stream:
            consumed = 0
            for lineno, raw in enumerate(stream, 1):
                if options.progress is not None:  # bytes of the file on disk, as sized
                    now = disk.tell()
                    options.progress(now - consumed)
                    consumed = now
                if not raw.strip():
                    continue
                report.lines += 1
                try:
                    value = json.loads(raw)
                except (ValueError, RecursionError) as exc:  # bad, undecodable, too deep
                    options.fail(TraceError(name, f"line {lineno}", f"invalid JSON: {exc}",
                                            SKIP_HINT))
                    continue
                if not isinstance(value, dict):
                    options.fail(TraceError(name, f"line {lineno}", "not a JSON object",
                                            SKIP_HINT))
                    continue
                yield lineno, Fields(value, name, "", lineno)
    except (OSError, EOFError) as exc:
        where = f"line {lineno + 1}" if lineno else None
        raise TraceError(name, where, f"cannot read: {exc}") from exc


def first_object(file: Path, max_lines: int = 20) -> dict[str, object] | None:
    """The first JSON object among the first ``max_lines`` non-blank lines of ``file``
    (``None`` if none parses): a cheap format sniff."""
    with closing(first_objects(file, max_lines)) as objects:
        return next(objects, None)


def first_objects(file: Path, max_lines: int = 20) -> Generator[dict[str, object], None, None]:
    """The JSON objects among the first ``max_lines`` non-blank lines of ``file``, in
    order (lines that do not parse are passed over; nothing if the file is unreadable):
    a cheap format sniff that can look past a few leading bookkeeping lines."""
    try:
        with open_binary(file) as stream:
            seen = 0
            for raw in stream:
                if not raw.strip():
                    continue
                seen += 1
                try:
                    value = json.loads(raw)
                except (ValueError, RecursionError):
                    value = None
                if isinstance(value, dict):
                    yield value
                if seen >= max_lines:
                    break
    except (OSError, EOFError):
        return


def parse_time(obj: Fields, key: str = "timestamp") -> float:
    """An ISO-8601 timestamp field as POSIX seconds; :class:`TraceError` if malformed."""
    text = obj.text(key)
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise obj.error(f"not an ISO-8601 timestamp: {text!r}", key, SKIP_HINT) from None


def walk_files(paths: list[Path], accept: Callable[[Path], bool]) -> list[Path]:
    """Every file under ``paths`` (files as given, directories recursively, sorted) that
    ``accept`` keeps; a missing path is a :class:`TraceError`."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.is_file() and accept(p)))
        elif path.is_file():
            out.append(path)
        else:
            raise TraceError(path, None, "no such file or directory")
    return out
