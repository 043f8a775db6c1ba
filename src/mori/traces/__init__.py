"""Agent traces: the canonical model, the loaders, and the default trace set.

``load_traces(path)`` reads any accepted form; ``default_traces()`` the shipped set;
``read_traceset`` / ``write_traceset`` the canonical JSONL format. Every input problem is
a :class:`TraceError` naming the file and the line or field at fault.
"""

from mori.traces.errors import TraceError
from mori.traces.jsonl import read_traceset, write_traceset
from mori.traces.kvcache_tester import load_kvcache_tester_dir, load_kvcache_tester_file
from mori.traces.loading import default_traces, load_traces
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet

__all__ = [
    "GapKind",
    "ProgramTrace",
    "Step",
    "SubagentSpawn",
    "TraceError",
    "TraceSet",
    "default_traces",
    "load_kvcache_tester_dir",
    "load_kvcache_tester_file",
    "load_traces",
    "read_traceset",
    "write_traceset",
]
