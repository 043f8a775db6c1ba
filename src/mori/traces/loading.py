"""Load a trace set from whatever form it comes in, and the sets MORI ships.

Accepted forms (see :func:`load_traces`): a canonical ``.jsonl`` / ``.jsonl.gz`` file
(:mod:`mori.traces.jsonl`), kv-cache-tester ``.json`` traces (a file or a directory of
them), Claude Code transcripts (a session ``.jsonl`` or a project folder) and Codex
rollouts (a ``rollout-*.jsonl`` or a folder of them), TraceLab round traces (``.jsonl``,
``.jsonl.gz`` or ``.duckdb``): every format of
:data:`mori.traces.importers.IMPORTERS`; or the name of a shipped set
(:data:`SHIPPED_TRACES`, package data in ``mori/data``) when no file of that name exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from mori.core.registry import Registry
from mori.traces.errors import TraceError
from mori.traces.import_common import ImportOptions
from mori.traces.importers import IMPORTERS, detect_format
from mori.traces.jsonl import read_traceset
from mori.traces.kvcache_tester import load_kvcache_tester_dir, load_kvcache_tester_file
from mori.traces.model import TraceSet

DEFAULT_TRACES_PACKAGE = "mori.data"
DEFAULT_TRACES_FILE = "default_traces.jsonl.gz"
DEFAULT_TRACE_SET = "kv-cache-tester-31"
ACCEPTED_FORMS = (
    "a directory of kv-cache-tester *.json files, a kv-cache-tester .json file, "
    "a MORI .jsonl / .jsonl.gz trace file, a Claude Code session .jsonl or project "
    "folder, a Codex rollout-*.jsonl or folder of them, or a TraceLab round trace "
    "(.jsonl, .jsonl.gz or .duckdb)"
)


@dataclass(frozen=True, slots=True)
class ShippedTraceSet:
    """A trace set shipped with MORI as package data (a canonical trace file).

    ``name``: the set's name (also the name in its file's header), usable wherever a
    trace path is taken; ``file``: its file in ``mori/data``; ``description``: where the
    traces come from; ``licence``: their licence (SPDX id); ``notice``: the files beside
    it that hold the attribution and the licence text.
    """

    name: str
    file: str
    description: str
    licence: str
    notice: tuple[str, ...] = ()

    def resource(self) -> Traversable:
        """The set's file in the installed package."""
        return resources.files(DEFAULT_TRACES_PACKAGE).joinpath(self.file)

    def load(self) -> TraceSet:
        """The trace set, read anew from the package data on each call."""
        with resources.as_file(self.resource()) as file:
            return read_traceset(file, hashes=False)

    def size_bytes(self) -> int:
        """The size of the set's file on disk."""
        with resources.as_file(self.resource()) as file:
            return file.stat().st_size


SHIPPED_TRACES: Registry[ShippedTraceSet] = Registry("shipped trace set")
SHIPPED_TRACES.register(DEFAULT_TRACE_SET, ShippedTraceSet(
    DEFAULT_TRACE_SET, DEFAULT_TRACES_FILE,
    "31 real Claude Code sessions (kv-cache-tester traces, captured by WEKA)",
    "Apache-2.0", ("NOTICE", "LICENSE-kv-cache-tester")))
SHIPPED_TRACES.freeze()


def shipped_set_names_hint() -> str:
    """What a missing trace path could have been instead: the accepted forms and the
    names of the shipped sets."""
    return (f"expected {ACCEPTED_FORMS}, or the name of a shipped trace set: "
            f"{', '.join(SHIPPED_TRACES.names())}")


def shipped_traces(name: str) -> TraceSet:
    """The shipped trace set ``name`` (see :data:`SHIPPED_TRACES`); an unknown name is an
    :class:`~mori.core.registry.UnknownNameError` listing the shipped names."""
    return SHIPPED_TRACES.get(name).load()


def load_traces(path: str | os.PathLike[str], format: str | None = None) -> TraceSet:
    """Load the trace set at ``path``, detecting its form by kind, name and first line.

    * ``*.jsonl`` / ``*.jsonl.gz``: a canonical MORI file (its first line is the
      ``mori-trace`` header), else a TraceLab round trace, a Codex rollout or a Claude
      Code transcript, told apart by their first line; a file that is none of these is
      read as a canonical file (whose error says what the header should be);
    * ``*.duckdb``: a TraceLab database (needs the ``duckdb`` package);
    * ``*.json``: one kv-cache-tester trace (set named after the file stem);
    * a directory: Codex rollouts or Claude Code transcripts when it holds some, else
      every ``*.json`` in it, as kv-cache-tester traces (set named after the directory);
    * the name of a shipped set (:data:`SHIPPED_TRACES`, e.g. ``kv-cache-tester-31``)
      when no file or directory of that name exists: that set (``format`` unused).

    ``format`` (an :data:`~mori.traces.importers.IMPORTERS` name) skips the detection.
    Block hashes are not kept (a replay does not need them; ``mori trace import``
    keeps them). Raises :class:`TraceError` if ``path`` does not exist and is no shipped
    set's name (the message lists the accepted forms and the shipped names), has another
    form (the message lists the accepted ones), or its content is malformed.
    """
    file = os.fspath(path)
    p = Path(file)
    if not p.exists():
        if file in SHIPPED_TRACES:
            return shipped_traces(file)
        raise TraceError(file, None, "no such file or directory", shipped_set_names_hint())
    name = p.name.lower()
    if format is None:
        format = detect_format(p)
        if format is None:
            if p.is_dir():
                format = "kv-cache-tester"
            elif name.endswith((".jsonl", ".jsonl.gz")):
                format = "mori"
            else:
                raise TraceError(
                    file, None, "unrecognized trace form", f"expected {ACCEPTED_FORMS}"
                )
    if format == "mori" and p.is_file():
        return read_traceset(file, hashes=False)
    if format == "kv-cache-tester":
        if p.is_dir():
            return load_kvcache_tester_dir(file)
        return TraceSet(name=p.stem, programs=(load_kvcache_tester_file(file),))
    importer = IMPORTERS.get(format)
    programs = tuple(importer.programs([p], ImportOptions(keep_hashes=False)))
    if not programs:
        raise TraceError(file, None, f"no LLM call found in these {format} traces")
    set_name = p.resolve().name if p.is_dir() else p.name.split(".jsonl")[0].split(".duckdb")[0]
    return TraceSet(name=set_name, programs=programs)


def default_traces() -> TraceSet:
    """The trace set shipped with MORI that runs use by default: 31 real Claude Code
    sessions (``kv-cache-tester-31``).

    Read from ``mori/data/default_traces.jsonl.gz`` (package data; attribution in
    ``mori/data/NOTICE``). Each call reads the file anew.
    """
    return shipped_traces(DEFAULT_TRACE_SET)
