"""MORI against the best baseline in every cell of a grid: ``mori sweep never-loses``'s
table and heat map.

Reads the ``sweep.json`` of one or more ``mori sweep`` output folders (later folders'
runs replace earlier ones'), and for each cell (preset, replicas, CPU ratio, programs
per replica) divides the candidate's throughput by the best baseline's. Prints one table
per preset and replicas, the cells below 1.0, the paper settings' check against the
paper's MORI (CPU ratio 1 and 2, 50-80 programs: within 2%), and TTFT p90 where the
throughput ties (within 2%); ``--plot`` draws the ratios as a heat map.

    mori sweep never-loses --out runs/never-loses
    python bench/never_loses.py runs/never-loses --plot docs/img/never-loses.png
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import sweep_runs

Cell = tuple[str, int, float, int]  # preset, replicas, cpu ratio, programs per replica


def load(folders: list[Path]) -> dict[Cell, dict[str, dict[str, Any]]]:
    """Every run of the folders' ``sweep.json``, by cell and policy."""
    cells: dict[Cell, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in sweep_runs(folders, "never_loses"):
        cell = (r["hardware"], r["replicas"], r["cpu_ratio"], r["programs_per_replica"])
        cells[cell][r["policy"]] = r
    return cells


def ratios(cells: dict[Cell, dict[str, dict[str, Any]]], candidate: str,
           baselines: list[str]) -> dict[Cell, tuple[float, str]]:
    """Per cell: the candidate's throughput over the best baseline's, and which it was."""
    out: dict[Cell, tuple[float, str]] = {}
    for cell, runs in cells.items():
        present = [b for b in baselines if b in runs]
        if candidate not in runs or not present:
            continue
        best = max(present, key=lambda b: runs[b]["output_tokens_per_s"])
        denom = runs[best]["output_tokens_per_s"]
        out[cell] = (runs[candidate]["output_tokens_per_s"] / denom if denom else math.inf, best)
    return out


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="mori sweep output folders")
    ap.add_argument("--policy", default="mori", help="the candidate (default: mori)")
    ap.add_argument("--baselines", default="thunderagent,thunderagent+offload,lru-offload")
    ap.add_argument("--paper", default="mori-paper",
                    help="the paper's MORI, for the paper settings' check")
    ap.add_argument("--plot", type=Path, help="draw the ratios as a heat map (PNG)")
    a = ap.parse_args()
    cells = load(a.folders)
    r = ratios(cells, a.policy, a.baselines.split(","))
    if not r:
        sys.exit(f"never_loses: no cell has both {a.policy} and a baseline")
    groups = sorted({(c[0], c[1]) for c in r})
    cpus = sorted({c[2] for c in r})
    progs = sorted({c[3] for c in r})
    for preset, dp in groups:
        print(f"\n{preset}, DP={dp}: {a.policy} / best of {a.baselines}")
        print("cpu \\ programs " + "".join(f"{n:>8}" for n in progs))
        for cpu in cpus:
            row = [r.get((preset, dp, cpu, n)) for n in progs]
            print(f"{cpu:<15g}" + "".join(f"{x[0]:8.3f}" if x else "       -" for x in row))
    print(f"\nby CPU ratio: min and geomean of {a.policy} (and {a.paper}) / best baseline")
    rp = ratios(cells, a.paper, a.baselines.split(","))
    for cpu in cpus:
        mine = [v[0] for c, v in r.items() if c[2] == cpu]
        theirs = [v[0] for c, v in rp.items() if c[2] == cpu]
        line = f"  cpu {cpu:<5g} {min(mine):.3f} / {_geomean(mine):.3f}"
        if theirs:
            line += f"   ({a.paper}: {min(theirs):.3f} / {_geomean(theirs):.3f})"
        print(line)
    below = sorted((v[0], c, v[1]) for c, v in r.items() if v[0] < 1.0)
    print(f"\ncells: {len(r)}; below 1.0: {len(below)}; "
          f"min {min(v[0] for v in r.values()):.3f}; "
          f"geomean {math.exp(sum(math.log(v[0]) for v in r.values()) / len(r)):.3f}")
    for ratio, (preset, dp, cpu, n), best in below:
        print(f"  {ratio:.3f}  {preset} DP={dp} cpu {cpu:g} {n} programs (best: {best})")
    paper = [(c, runs[a.policy]["output_tokens_per_s"] / runs[a.paper]["output_tokens_per_s"])
             for c, runs in cells.items() if a.policy in runs and a.paper in runs
             and c[2] in (1.0, 2.0) and 50 <= c[3] <= 80]
    if paper:
        worst = min(paper, key=lambda t: t[1])
        print(f"paper settings: {a.policy} / {a.paper} min {worst[1]:.3f} at {worst[0]}; "
              f"{sum(1 for _, x in paper if x < 0.98)} of {len(paper)} below 0.98")
    ties = []
    for c, (ratio, best) in r.items():
        if abs(ratio - 1.0) <= 0.02:
            mine = cells[c][a.policy]["ttft_p90_s"]
            theirs = cells[c][best]["ttft_p90_s"]
            if mine is not None and theirs is not None and mine > theirs * 1.02 + 0.05:
                ties.append((c, mine, theirs, best))
    print(f"ties (within 2%) with a worse TTFT p90: {len(ties)}")
    for c, mine, theirs, best in sorted(ties):
        print(f"  {c}: {mine:.2f} s vs {best} {theirs:.2f} s")
    if a.plot:
        plot(r, groups, cpus, progs, a.policy, a.plot)
        print(f"wrote {a.plot}")
    return 0


def plot(r: dict[Cell, tuple[float, str]], groups: list[tuple[str, int]], cpus: list[float],
         progs: list[int], policy: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    fig, axes = plt.subplots(1, len(groups), figsize=(3.0 * len(groups), 3.4), squeeze=False)
    values = [v[0] for v in r.values()]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(values), 0.9), vmax=max(max(values), 1.1))
    im = None
    for ax, (preset, dp) in zip(axes[0], groups, strict=True):
        grid = [[r.get((preset, dp, cpu, n), (math.nan, ""))[0] for n in progs] for cpu in cpus]
        im = ax.imshow(grid, cmap="RdYlGn", norm=norm, origin="lower", aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(progs)), [str(n) for n in progs])
        ax.set_yticks(range(len(cpus)),
                      [f"{c:g}" for c in cpus] if ax is axes[0][0] else [""] * len(cpus))
        ax.set_xlabel("programs per replica")
        ax.set_title(f"{preset}\nDP={dp}", fontsize=8)
    axes[0][0].set_ylabel("CPU ratio")
    assert im is not None
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8,
                 label=f"{policy} / best baseline (throughput)")
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    raise SystemExit(main())
