"""Load a trace set from whatever form it comes in, and the default set MORI ships.

Accepted forms (see :func:`load_traces`): a directory of kv-cache-tester ``*.json``
files, one kv-cache-tester ``.json`` file, or a canonical ``.jsonl`` / ``.jsonl.gz``
file (:mod:`mori.traces.jsonl`).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from mori.traces.errors import TraceError
from mori.traces.jsonl import read_traceset
from mori.traces.kvcache_tester import load_kvcache_tester_dir, load_kvcache_tester_file
from mori.traces.model import TraceSet

DEFAULT_TRACES_PACKAGE = "mori.data"
DEFAULT_TRACES_FILE = "default_traces.jsonl.gz"
ACCEPTED_FORMS = (
    "a directory of kv-cache-tester *.json files, a kv-cache-tester .json file, "
    "or a MORI .jsonl / .jsonl.gz trace file"
)


def load_traces(path: str | os.PathLike[str]) -> TraceSet:
    """Load the trace set at ``path``, detecting its form by kind and file name.

    * a directory: every ``*.json`` in it, as kv-cache-tester traces (set named after the
      directory);
    * ``*.json``: one kv-cache-tester trace (set named after the file stem);
    * ``*.jsonl`` or ``*.jsonl.gz``: a canonical MORI trace file.

    Raises :class:`TraceError` if ``path`` does not exist, has another form (the message
    lists the accepted ones), or its content is malformed.
    """
    file = os.fspath(path)
    p = Path(file)
    if p.is_dir():
        return load_kvcache_tester_dir(file)
    if not p.exists():
        raise TraceError(file, None, "no such file or directory", f"expected {ACCEPTED_FORMS}")
    name = p.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return read_traceset(file)
    if name.endswith(".json"):
        return TraceSet(name=p.stem, programs=(load_kvcache_tester_file(file),))
    raise TraceError(file, None, "unrecognized trace form", f"expected {ACCEPTED_FORMS}")


def default_traces() -> TraceSet:
    """The trace set shipped with MORI: 31 real Claude Code sessions (kv-cache-tester-31).

    Read from ``mori/data/default_traces.jsonl.gz`` (package data; attribution in
    ``mori/data/NOTICE``). Each call reads the file anew.
    """
    resource = resources.files(DEFAULT_TRACES_PACKAGE).joinpath(DEFAULT_TRACES_FILE)
    with resources.as_file(resource) as file:
        return read_traceset(file)
