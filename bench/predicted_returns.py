"""How well a gateway can predict when a program in a tool call returns
(``mori.core.returns``): the error of each rule on real traces.

    python bench/predicted_returns.py [SET ...] [--window 5] [--json OUT]

Each ``SET`` is anything ``mori.traces.load_traces`` reads (a shipped set's name, a
kv-cache-tester folder or file, Claude Code transcripts, a canonical file); by default
the shipped set. For every tool call in the traces (a step whose gap is ``tool``), each
rule of ``mori.core.returns.RULES`` predicts its length from what came before it, and the
error is the predicted minus the actual seconds. The programs' own history is the
acting part of their last ``--window`` tool calls (the idleness window); the tools' and
the kind's histories are shared by all programs, fed in an approximate time order: the
traces carry no start times, so the walk takes every program's first call, then every
program's second, and so on (a program's calls in its own order). Calls that spawn
subagents are left out (their length is the subagents' lives plus a residual gap, which
the trace does not give as one number): counted as ``skipped``.

Reported per set and rule: the number of calls, the median and the 10th and 90th
percentiles of the signed error (s), the median absolute error (s) and the share of
calls predicted within a factor of two of their length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # `bench.` when run as a script

from bench.benchutil import pct  # noqa: E402
from mori.cli.table import format_table  # noqa: E402
from mori.core.returns import RULES, ReturnConfig, ReturnPredictor  # noqa: E402
from mori.traces import GapKind, ProgramTrace, TraceSet, default_traces, load_traces  # noqa: E402


@dataclass(frozen=True)
class RuleError:
    """One rule's errors on one set (seconds; ``within_2x``: a share)."""

    set: str
    rule: str
    calls: int
    skipped: int
    median_s: float
    p10_s: float
    p90_s: float
    median_abs_s: float
    within_2x: float


def programs(traces: TraceSet) -> Iterator[ProgramTrace]:
    """Every program, subagents included (each a program of its own)."""
    stack = list(reversed(traces.programs))
    while stack:
        p = stack.pop()
        yield p
        for step in p.steps:
            stack.extend(s.program for s in step.subagents)


def errors(traces: TraceSet, rule: str, window: int) -> tuple[list[tuple[float, float]], int]:
    """(predicted, actual) seconds of every tool call of ``traces`` under ``rule``, and
    how many calls were skipped (the module docstring)."""
    progs = list(programs(traces))
    predictor = ReturnPredictor(ReturnConfig(rule=rule))
    own = [deque[float](maxlen=window) for _ in progs]
    out: list[tuple[float, float]] = []
    skipped = 0
    for k in range(max((len(p.steps) for p in progs), default=0)):
        for i, p in enumerate(progs):
            if k >= len(p.steps):
                continue
            step = p.steps[k]
            if step.gap_kind is not GapKind.TOOL:
                continue
            if step.subagents:
                skipped += 1
                continue
            out.append((predictor.expect_s(own[i], step.tool_names), step.gap_s))
            predictor.observe(step.gap_s, step.tool_names)
            own[i].append(step.gap_s)
    return out, skipped


def measure(traces: TraceSet, name: str, window: int) -> list[RuleError]:
    rows = []
    for rule in RULES:
        pairs, skipped = errors(traces, rule, window)
        if not pairs:
            continue
        err = sorted(p - a for p, a in pairs)
        within = sum(1 for p, a in pairs if a / 2 <= p <= 2 * a) / len(pairs)
        rows.append(RuleError(name, rule, len(pairs), skipped, statistics.median(err),
                              pct(err, 10), pct(err, 90),
                              statistics.median(abs(e) for e in err), within))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sets", nargs="*", help="trace sets (default: the shipped set)")
    ap.add_argument("--window", type=int, default=5,
                    help="a program's own tool calls kept (the idleness window; default 5)")
    ap.add_argument("--json", type=Path, help="write the rows to this file")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window must be >= 1")
    sets = [(default_traces(), "shipped")] if not args.sets else [
        (load_traces(s), Path(s).name or s) for s in args.sets]
    rows = [r for traces, name in sets for r in measure(traces, name, args.window)]
    print(format_table(
        ["set", "rule", "calls", "skipped", "median s", "p10 s", "p90 s", "median |err| s",
         "within 2x"],
        [[r.set, r.rule, str(r.calls), str(r.skipped), f"{r.median_s:+.1f}",
          f"{r.p10_s:+.1f}", f"{r.p90_s:+.1f}", f"{r.median_abs_s:.1f}",
          f"{r.within_2x:.0%}"] for r in rows],
        right=[False, False, True, True, True, True, True, True, True]))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
