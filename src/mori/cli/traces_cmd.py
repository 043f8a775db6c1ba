"""``mori traces``: list the trace sets shipped with MORI.

One row per shipped set (:data:`~mori.traces.loading.SHIPPED_TRACES`): its name, number
of programs (top-level), subagents and steps (subagents' included), its size on disk
and its licence. A set's name works wherever a trace path is taken (``--traces NAME``,
``mori trace stats NAME``) when no file of that name exists.

``add_traces_parser(sub)`` adds the command to ``mori``'s subparsers; ``run_traces(args)``
runs it.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from typing import Any

from mori.cli.table import format_table
from mori.traces.errors import TraceError
from mori.traces.loading import DEFAULT_TRACE_SET, DEFAULT_TRACES_PACKAGE, SHIPPED_TRACES

TRACES_EPILOG = """\
A set's name works wherever a trace path is taken, when no file of that name exists:

  mori simulate --traces kv-cache-tester-31
  mori trace stats kv-cache-tester-31
"""


def add_traces_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``traces`` to ``mori``'s subparsers."""
    parser: argparse.ArgumentParser = sub.add_parser(
        "traces", help="list the shipped trace sets",
        description="List the trace sets shipped with MORI: programs, steps, size on "
        "disk and licence.",
        epilog=TRACES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def format_size(size: int) -> str:
    """A byte count in B, KiB or MiB (one decimal)."""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KiB"
    return f"{size / (1024 * 1024):.1f} MiB"


def list_traces() -> str:
    """The listing: one row per shipped set, the default marked, then where the
    attribution and licence texts are."""
    rows = []
    notices: list[str] = []
    for name in SHIPPED_TRACES.names():
        shipped = SHIPPED_TRACES.get(name)
        ts = shipped.load()
        everything = [p for top in ts.programs for p in top.all_programs()]
        rows.append((
            name + ("*" if name == DEFAULT_TRACE_SET else ""),
            str(len(ts.programs)),
            str(len(everything) - len(ts.programs)),
            f"{sum(len(p.steps) for p in everything):,}",
            format_size(shipped.size_bytes()),
            shipped.licence,
            shipped.description,
        ))
        notices.extend(f for f in shipped.notice if f not in notices)
    headers = ("set", "programs", "subagents", "steps", "size", "licence", "source")
    table = format_table(headers, rows, (False, True, True, True, True, False, False))
    data = resources.files(DEFAULT_TRACES_PACKAGE)
    lines = [table, "",
             "* the default of `mori simulate`, `mori sweep` and `mori replay`",
             "A set's name works wherever a trace path is taken (--traces NAME, "
             "`mori trace stats NAME`).",
             "Attribution and licence texts: "
             + ", ".join(str(data.joinpath(f)) for f in notices)]
    return "\n".join(lines)


def run_traces(args: argparse.Namespace) -> int:
    """Run ``mori traces``; return the exit status (2 if a shipped file is unreadable)."""
    del args
    try:
        text = list_traces()
    except (TraceError, OSError) as e:
        print(f"mori traces: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0
