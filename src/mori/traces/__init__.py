"""Agent traces: the canonical model, the importers, the analysis and the generator.

``load_traces(path)`` reads any importable form (canonical file, kv-cache-tester, Claude
Code transcripts, Codex rollouts; :data:`IMPORTERS`) or a shipped set's name;
``default_traces()`` the default shipped set, ``shipped_traces(name)`` any of
:data:`SHIPPED_TRACES`; ``read_traceset`` / ``write_traceset`` / :class:`TraceWriter`
the canonical JSONL format; ``analyze`` the paper's workload analysis; ``synthesize``
programs with given statistics. Every input problem is a :class:`TraceError` naming the
file and the line or field at fault.
"""

from mori.traces.errors import TraceError
from mori.traces.import_common import ImportOptions, ImportReport
from mori.traces.importers import IMPORTERS, Importer, detect_format
from mori.traces.jsonl import TraceWriter, iter_programs, read_traceset, write_traceset
from mori.traces.kvcache_tester import load_kvcache_tester_dir, load_kvcache_tester_file
from mori.traces.loading import (
    SHIPPED_TRACES,
    ShippedTraceSet,
    default_traces,
    load_traces,
    shipped_traces,
)
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet
from mori.traces.stats import TraceStats, analyze
from mori.traces.synth import SynthSpec, synthesize

__all__ = [
    "IMPORTERS",
    "SHIPPED_TRACES",
    "GapKind",
    "ImportOptions",
    "ImportReport",
    "Importer",
    "ProgramTrace",
    "Step",
    "SubagentSpawn",
    "ShippedTraceSet",
    "SynthSpec",
    "TraceError",
    "TraceSet",
    "TraceStats",
    "TraceWriter",
    "analyze",
    "default_traces",
    "detect_format",
    "iter_programs",
    "load_kvcache_tester_dir",
    "load_kvcache_tester_file",
    "load_traces",
    "read_traceset",
    "shipped_traces",
    "synthesize",
    "write_traceset",
]
