"""``--plot FILE.png``: the MORI paper's figure layout for a grid of runs.

One row of three panels per (hardware, CPU ratio) setting: output throughput, steps/s and
TTFT (mean solid, p90 dashed in the same colour) against the number of programs, one
line with markers per policy. Rendered with matplotlib's Agg backend (no display).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display needed

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from mori.cli.table import shown_programs  # noqa: E402
from mori.sim.metrics import RunResult  # noqa: E402

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_PANELS: tuple[tuple[str, Callable[[RunResult], float]], ...] = (
    ("Output throughput (tok/s)", lambda r: r.output_tokens_per_s),
    ("Steps/s", lambda r: r.steps_per_s),
    ("TTFT (s): mean, p90 dashed", lambda r: r.ttft_mean_s),
)


def _legend_and_save(fig: Figure, path: Path,
                     style: dict[str, tuple[tuple[float, float, float, float], str]]) -> None:
    """One legend above the panels (each policy, and the p90 dashes), then save."""
    handles = [Line2D([], [], color=c, marker=m, label=p) for p, (c, m) in style.items()]
    handles.append(Line2D([], [], color="grey", linestyle="--", label="TTFT p90"))
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    fig.savefig(path, dpi=120)


def _series(runs: Sequence[RunResult], metric: Callable[[RunResult], float], per_replica: bool
            ) -> tuple[list[int], list[float]]:
    pts = sorted((shown_programs(r, per_replica), metric(r)) for r in runs)
    return [p for p, _ in pts], [v for _, v in pts]


def _setting(r: RunResult) -> tuple[str, float, int, float]:
    """A plot row: (hardware, CPU ratio, replicas, disk ratio)."""
    c = r.config
    return c.hardware, c.cpu_ratio, c.replicas, c.disk_ratio


def plot_results(results: Sequence[RunResult], path: Path, per_replica: bool = False) -> None:
    """Draw ``results`` (any grid order) and save them as a PNG at ``path`` (dpi 120).

    One row per (hardware, CPU ratio, replicas). ``per_replica``: the x axis counts
    programs per replica (the title says so where replicas > 1).
    """
    settings = list(dict.fromkeys(_setting(r) for r in results))
    policies = list(dict.fromkeys(r.config.policy for r in results))
    colors = plt.get_cmap("tab10")
    style = {p: (colors(i % 10), _MARKERS[i % len(_MARKERS)]) for i, p in enumerate(policies)}
    xs_all = sorted({shown_programs(r, per_replica) for r in results})
    fig, axes = plt.subplots(len(settings), 3, figsize=(15, 3.9 * len(settings) + 0.8),
                             squeeze=False)
    try:
        for row, setting in enumerate(settings):
            hw, cpu, dp, disk = setting
            here = [r for r in results if _setting(r) == setting]
            where = hw if not disk else f"{hw} disk {disk:g}x"
            if per_replica and dp > 1:
                where += f" DP={dp} (programs per replica)"
            for col, (label, metric) in enumerate(_PANELS):
                ax: Axes = axes[row][col]
                for pol in policies:
                    runs = [r for r in here if r.config.policy == pol]
                    if not runs:
                        continue
                    color, marker = style[pol]
                    x, y = _series(runs, metric, per_replica)
                    ax.plot(x, y, marker=marker, color=color, label=pol, linewidth=1.8)
                    if col == 2:
                        x, y = _series(runs, lambda r: r.ttft_p90_s, per_replica)
                        ax.plot(x, y, marker=marker, color=color, linestyle="--",
                                linewidth=1.2, markersize=4, alpha=0.8)
                ax.set_title(f"{where}, CPU ratio {cpu:g}\n{label}", fontsize=10)
                ax.set_xlabel("programs")
                ax.set_xticks(xs_all)
                ax.set_ylim(bottom=0)
                ax.grid(True, alpha=0.3)
        _legend_and_save(fig, path, style)
    finally:
        plt.close(fig)


def scaling_groups(results: Sequence[RunResult]) -> dict[tuple[str, float], list[RunResult]]:
    """The (hardware, CPU ratio) settings whose runs span more than one replica count,
    each with its runs (the input of ``plot_scaling``)."""
    groups: dict[tuple[str, float], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.config.hardware, r.config.cpu_ratio), []).append(r)
    return {k: v for k, v in groups.items() if len({r.config.replicas for r in v}) > 1}


def plot_scaling(results: Sequence[RunResult], path: Path) -> None:
    """Draw how ``results`` (one hardware and CPU ratio) scale with the replicas: one row
    of three panels (output throughput, steps/s, TTFT mean solid and p90 dashed) per
    programs-per-replica value, against the replica count (log scale), one line per
    policy. Saved as a PNG at ``path`` (dpi 120)."""
    loads = sorted({r.config.programs_per_replica for r in results})
    policies = list(dict.fromkeys(r.config.policy for r in results))
    colors = plt.get_cmap("tab10")
    style = {p: (colors(i % 10), _MARKERS[i % len(_MARKERS)]) for i, p in enumerate(policies)}
    replicas = sorted({r.config.replicas for r in results})
    hw, cpu = results[0].config.hardware, results[0].config.cpu_ratio
    fig, axes = plt.subplots(len(loads), 3, figsize=(15, 3.9 * len(loads) + 0.8),
                             squeeze=False)
    try:
        for row, load in enumerate(loads):
            here = [r for r in results if r.config.programs_per_replica == load]
            for col, (label, metric) in enumerate(_PANELS):
                ax: Axes = axes[row][col]
                for pol in policies:
                    runs = sorted((r for r in here if r.config.policy == pol),
                                  key=lambda r: r.config.replicas)
                    if not runs:
                        continue
                    color, marker = style[pol]
                    x = [r.config.replicas for r in runs]
                    ax.plot(x, [metric(r) for r in runs], marker=marker, color=color,
                            label=pol, linewidth=1.8)
                    if col == 2:
                        ax.plot(x, [r.ttft_p90_s for r in runs], marker=marker, color=color,
                                linestyle="--", linewidth=1.2, markersize=4, alpha=0.8)
                ax.set_title(f"{hw}, CPU ratio {cpu:g}, {load:g} programs per replica\n"
                             f"{label}", fontsize=10)
                ax.set_xlabel("replicas")
                ax.set_xscale("log")
                ax.set_xticks(replicas, [str(n) for n in replicas])
                ax.minorticks_off()
                ax.set_ylim(bottom=0)
                ax.grid(True, alpha=0.3)
        _legend_and_save(fig, path, style)
    finally:
        plt.close(fig)
