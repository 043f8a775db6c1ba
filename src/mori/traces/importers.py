"""The trace importers: one registry entry per input format.

Every importer turns paths (files or folders) into a stream of top-level
:class:`~mori.traces.model.ProgramTrace` s (subagents nested below their parents), so a
whole folder is converted without holding it in memory. ``mori trace import FORMAT`` and
:func:`mori.traces.loading.load_traces` both go through :data:`IMPORTERS`;
:func:`detect_format` picks the importer for a path, trying :data:`DETECTION_ORDER`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mori.core.registry import Registry
from mori.traces import claude_code, codex, tracelab
from mori.traces.errors import TraceError
from mori.traces.import_common import ImportOptions, first_object, walk_files
from mori.traces.jsonl import FORMAT as CANONICAL_FORMAT
from mori.traces.jsonl import iter_programs as iter_canonical
from mori.traces.kvcache_tester import load_kvcache_tester_file
from mori.traces.model import ProgramTrace


@dataclass(frozen=True, slots=True)
class Importer:
    """One input format.

    ``detect(path)``: whether ``path`` (a file or folder) looks like this format (cheap:
    reads at most a few lines). ``files(paths)``: the input files under ``paths`` (for
    sizing a progress bar). ``programs(paths, options)``: the programs, streamed.
    """

    name: str
    description: str
    detect: Callable[[Path], bool]
    files: Callable[[Sequence[Path]], list[Path]]
    programs: Callable[[Sequence[Path], ImportOptions], Iterator[ProgramTrace]]


IMPORTERS: Registry[Importer] = Registry("trace format")
DETECTION_ORDER = ("mori", "tracelab", "codex", "claude-code", "kv-cache-tester")


def _is_canonical(path: Path) -> bool:
    if path.is_dir() or not path.name.lower().endswith((".jsonl", ".jsonl.gz")):
        return False
    obj = first_object(path, max_lines=1)
    return obj is not None and obj.get("format") == CANONICAL_FORMAT


def _canonical_files(paths: Sequence[Path]) -> list[Path]:
    return walk_files(list(paths), lambda p: p.name.lower().endswith((".jsonl", ".jsonl.gz")))


def _canonical_programs(paths: Sequence[Path], options: ImportOptions) -> Iterator[ProgramTrace]:
    for file in _canonical_files(paths):
        options.report.files += 1
        if options.progress is not None:
            options.progress(file.stat().st_size)
        for program in iter_canonical(file):
            everything = program.all_programs()
            options.report.programs += 1
            options.report.subagents += len(everything) - 1
            options.report.steps += sum(len(p.steps) for p in everything)
            yield program


def _is_kvcache_tester(path: Path) -> bool:
    if path.is_dir():
        return any(p.suffix == ".json" and p.is_file() for p in path.iterdir())
    return path.suffix.lower() == ".json"


def _kv_files(paths: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out.extend(sorted(p for p in path.iterdir() if p.suffix == ".json" and p.is_file()))
        elif path.is_file():
            out.append(path)
        else:
            raise TraceError(path, None, "no such file or directory")
    return out


def _kv_programs(paths: Sequence[Path], options: ImportOptions) -> Iterator[ProgramTrace]:
    for file in _kv_files(paths):
        options.report.files += 1
        if options.progress is not None:
            options.progress(file.stat().st_size)
        try:
            program = load_kvcache_tester_file(file, keep_hashes=options.keep_hashes)
        except TraceError as exc:
            options.fail(exc)  # one file is one record: skipping skips the file
            continue
        everything = program.all_programs()
        options.report.programs += 1
        options.report.subagents += len(everything) - 1
        options.report.steps += sum(len(p.steps) for p in everything)
        yield program


IMPORTERS.register("mori", Importer(
    "mori", "MORI's canonical trace files (.jsonl / .jsonl.gz, 'mori-trace' header)",
    _is_canonical, _canonical_files, _canonical_programs))
IMPORTERS.register("kv-cache-tester", Importer(
    "kv-cache-tester", "kv-cache-tester JSON traces (one .json per conversation, "
    "subagents included; a folder reads its *.json)",
    _is_kvcache_tester, _kv_files, _kv_programs))
IMPORTERS.register("claude-code", Importer(
    "claude-code", "Claude Code transcripts (~/.claude/projects/**/*.jsonl; a project "
    "folder at once, subagents/ and compactions linked)",
    claude_code.looks_like_claude_code, claude_code.session_files, claude_code.iter_programs))
IMPORTERS.register("codex", Importer(
    "codex", "Codex CLI rollouts (~/.codex/sessions/**/rollout-*.jsonl)",
    codex.looks_like_codex, codex.rollout_files, codex.iter_programs))
IMPORTERS.register("tracelab", Importer(
    "tracelab", "TraceLab round traces of Claude Code and Codex sessions (JSON Lines, "
    "optionally gzipped, one row per LLM call; or the .duckdb database, with "
    "mori[tracelab])",
    tracelab.looks_like_tracelab, tracelab.trace_files, tracelab.iter_programs))
IMPORTERS.freeze()


def detect_format(path: str | os.PathLike[str]) -> str | None:
    """The name of the first importer (in :data:`DETECTION_ORDER`) that recognizes
    ``path``, or ``None``."""
    p = Path(path)
    for name in DETECTION_ORDER:
        if IMPORTERS.get(name).detect(p):
            return name
    return None
