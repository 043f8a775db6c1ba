"""``mori trace stats --plot DIR``: the workload analysis figures.

Three PNGs: ``tool_gaps_cdf.png`` (CDF of tool-call waits, log scale, top-level programs
and subagents, the threshold marked), ``busy_phases_cdf.png`` (CDF of busy-phase
durations at each threshold) and ``context_growth.png`` (each top-level program's prompt
size against its call index). Rendered with matplotlib's Agg backend (no display).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display needed

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from mori.traces.model import TraceSet  # noqa: E402
from mori.traces.stats import TraceStats, busy_phases  # noqa: E402


def _cdf(ax: Axes, values: Sequence[float], label: str, **style: Any) -> None:
    xs = sorted(v for v in values if v > 0)
    if not xs:
        return
    n = len(xs)
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=f"{label} (n={n:,})",
            **style)


def plot_trace_stats(ts: TraceSet, stats: TraceStats, out_dir: Path) -> list[Path]:
    """Write the three figures into ``out_dir`` (created if needed); return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "tool_gaps_cdf.png", out_dir / "busy_phases_cdf.png",
             out_dir / "context_growth.png"]
    t = stats.threshold_s

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        _cdf(ax, stats.gaps_main, "top-level programs", linewidth=1.8)
        _cdf(ax, stats.gaps_subagents, "subagents", linewidth=1.2, linestyle="--")
        ax.axvline(t, color="grey", linestyle=":", linewidth=1.2)
        share = stats.main.short_calls_frac
        ax.set_title(f"{stats.name}: tool-call durations\n"
                     f"{100 * share:.0f} % under {t:g} s, holding "
                     f"{100 * stats.main.short_time_frac:.0f} % of tool time", fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("tool call (s)")
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(paths[0], dpi=120)
    finally:
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for phase in stats.main.busy_phases:
            values = [d for p in ts.programs for d in busy_phases(p, phase.threshold_s)]
            _cdf(ax, values, f"threshold {phase.threshold_s:g} s", linewidth=1.6)
        ax.set_title(f"{stats.name}: busy-phase durations (top-level programs)", fontsize=10)
        ax.set_xscale("log")
        ax.set_xlabel("busy phase (s)")
        ax.set_ylabel("CDF")
        ax.set_ylim(0, 1)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(paths[1], dpi=120)
    finally:
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for program in ts.programs:
            ax.plot(range(len(program.steps)), [s.prompt_tokens for s in program.steps],
                    linewidth=0.8, alpha=0.6)
        ax.set_title(f"{stats.name}: context growth, one line per program", fontsize=10)
        ax.set_xlabel("LLM call")
        ax.set_ylabel("prompt tokens")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(paths[2], dpi=120)
    finally:
        plt.close(fig)
    return paths
