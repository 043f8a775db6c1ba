"""Do MORI's gains hold for Codex's shape of workload? The paper's grid on a Claude-shaped
and a Codex-shaped synthetic set, beside the shipped Claude Code traces.

Generates two sets with ``mori trace synth`` from the figures TraceLab publishes per
agent (Zhu et al., arXiv 2606.30560; github.com/uw-syfi/TraceLab and its site; what is
published and what is estimated is in :data:`SHAPES` and docs/results.md), runs ``mori
sweep paper`` (or ``--sweep NAME``) on each and on the shipped traces, then prints each
set's workload figures (``mori trace stats``) and, per cell, MORI's and the paper's
MORI's throughput over the better of ThunderAgent and ThunderAgent with offloading.
Sweeps resume: rerunning with the same ``--out`` reuses the finished runs.

    python bench/provider_shapes.py --out /tmp/shapes --jobs 2
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.never_loses import load, ratios
from mori.traces.jsonl import write_traceset
from mori.traces.loading import load_traces, shipped_traces
from mori.traces.model import TraceSet
from mori.traces.stats import analyze
from mori.traces.synth import SynthSpec, synthesize

#: the two shapes; per TraceLab (per agent, 357,161 rows): output median 184 (Codex) /
#: 252 (Claude) tokens and mean growth per tool-triggered call 1,744 / 1,728 tokens are
#: published; the context ceilings are derived from the published prefix p99 (231,040 /
#: 918,111); the short-call shares, busy phases, phases per session and first prompts are
#: estimated from published medians and means (tool latency median ~626 ms / ~125 ms,
#: mean ~5 s / ~29 s; 136 / 52 calls a session), not measured on the rows
SHAPES: dict[str, SynthSpec] = {
    "claude-shaped": SynthSpec(
        short_calls_frac=0.80, short_time_frac=0.02, busy_median_s=20.0, busy_p90_s=90.0,
        phases_median=4.0, first_prompt_median=20_000, growth_per_call=1_700.0,
        output_median=252, max_context=1_000_000, provider="claude"),
    "codex-shaped": SynthSpec(
        short_calls_frac=0.85, short_time_frac=0.10, busy_median_s=30.0, busy_p90_s=150.0,
        phases_median=6.0, first_prompt_median=25_000, growth_per_call=1_750.0,
        output_median=184, max_context=256_000, provider="codex"),
}
SHIPPED = "kv-cache-tester-31"
TA = ["thunderagent", "thunderagent+offload"]


def build_sets(out: Path, programs: int, seed: int) -> dict[str, Path]:
    """Write the two synthetic sets into ``out``; the shipped set is taken by name."""
    paths: dict[str, Path] = {}
    for name, spec in SHAPES.items():
        path = out / f"{name}.jsonl.gz"
        if not path.exists():
            write_traceset(synthesize(replace(spec, programs=programs, seed=seed, name=name)),
                           path)
        paths[name] = path
    return paths


def sweep(name: str, traces: str, folder: Path, jobs: int) -> None:
    subprocess.run([sys.executable, "-m", "mori", "sweep", name, "--traces", traces,
                    "--out", str(folder), "--jobs", str(jobs), "--only-missing", "--quiet"],
                   check=True, stdout=subprocess.DEVNULL)


def workload_rows(sets: dict[str, TraceSet]) -> list[str]:
    """A Markdown table of each set's workload figures at 2 s."""
    stats = {name: analyze(ts).main for name, ts in sets.items()}
    rows = [
        ("programs", lambda p: f"{p.programs}"),
        ("LLM calls per program: median", lambda p: f"{p.llm_calls.median:.0f}"),
        ("tool calls under 2 s: share of calls", lambda p: f"{100 * p.short_calls_frac:.0f} %"),
        ("  ... share of tool time", lambda p: f"{100 * p.short_time_frac:.0f} %"),
        ("tool call s: median / p90", lambda p: f"{p.tool_gaps.median:.1f} / {p.tool_gaps.p90:.0f}"),
        ("busy phase s: median / p90",
         lambda p: next(f"{ph.durations.median:.0f} / {ph.durations.p90:.0f}"
                        for ph in p.busy_phases if ph.threshold_s == 2.0)),
        ("idle fraction: median", lambda p: f"{p.idle_fraction.median:.2f}"),
        ("first / peak prompt: median (k tokens)",
         lambda p: f"{p.first_prompt.median / 1e3:.0f} / {p.peak_prompt.median / 1e3:.0f}"),
    ]
    out = ["| | " + " | ".join(sets) + " |", "|---" * (len(sets) + 1) + "|"]
    for label, cell in rows:
        out.append(f"| {label} | " + " | ".join(cell(s) for s in stats.values()) + " |")
    return out


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for sets and sweeps")
    parser.add_argument("--sweep", default="paper", help="the named sweep (default: paper)")
    parser.add_argument("--programs", type=int, default=200, help="programs per set")
    parser.add_argument("--seed", type=int, default=0, help="the sets' seed")
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs per sweep")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    paths = build_sets(args.out, args.programs, args.seed)
    traces = {SHIPPED: SHIPPED, **{n: str(p) for n, p in paths.items()}}
    sets = {SHIPPED: shipped_traces(SHIPPED), **{n: load_traces(p) for n, p in paths.items()}}
    for name, source in traces.items():
        print(f"sweep {args.sweep} on {name} ...", file=sys.stderr, flush=True)
        sweep(args.sweep, source, args.out / f"sweep-{name}", args.jobs)
    print("\n".join(workload_rows(sets)))
    per_set = {name: {cand: ratios(load([args.out / f"sweep-{name}"]), cand, TA)
                      for cand in ("mori", "mori-paper")} for name in traces}
    cells = sorted(set.intersection(*(set(r["mori"]) & set(r["mori-paper"])
                                      for r in per_set.values())))
    if not cells:
        print(f"\nno cell of sweep {args.sweep!r} runs mori, mori-paper and ThunderAgent")
        return 0
    print("\nthroughput over the better of thunderagent, thunderagent+offload: mori | "
          "mori-paper\n")
    head = ["preset", "DP", "cpu", "programs", *traces]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for cell in cells:
        preset, dp, cpu, n = cell
        values = [f"{per_set[s]['mori'][cell][0]:.2f} \\| {per_set[s]['mori-paper'][cell][0]:.2f}"
                  for s in traces]
        print(f"| {preset} | {dp} | {cpu:g} | {n} | " + " | ".join(values) + " |")
    for cand in ("mori", "mori-paper"):
        summary = []
        for s in traces:
            xs = [per_set[s][cand][c][0] for c in cells]
            summary.append(f"{s} geomean {_geomean(xs):.3f} min {min(xs):.3f}")
        print(f"\n{cand}: " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
