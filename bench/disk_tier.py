"""Where a disk tier pays: ``mori sweep disk``'s runs as ratios to two-tier MORI.

Reads the ``sweep.json`` of one or more ``mori sweep disk`` output folders (one per trace
set: the records name their traces), and for each cell (traces, preset, CPU ratio,
programs per replica, disk ratio) divides throughput and TTFT by those of ``mori`` with
no disk tier in the same cell. Prints, per trace set and preset, a table per CPU ratio
(disk ratio x programs) for ``mori`` and for ``lru-offload`` with the same disk (the LRU
order over three tiers), with the disk hit rate beside; then the issue's target cell
(70B preset, CPU ratio 1, 160 programs); ``--plot`` draws the ``mori`` throughput ratios
as heat maps.

    mori sweep disk --out runs/disk
    mori trace synth --programs 200 -o runs/synth200.jsonl.gz
    mori sweep disk --traces runs/synth200.jsonl.gz --out runs/disk-synth
    python bench/disk_tier.py runs/disk runs/disk-synth --plot docs/disk-tier.png
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

Cell = tuple[str, str, float, int]  # traces, preset, cpu ratio, programs per replica
Runs = dict[Cell, dict[tuple[str, float], dict[str, Any]]]  # (policy, disk ratio) -> run


def load(folders: list[Path]) -> Runs:
    """Every run of the folders' ``sweep.json``, by cell, policy and disk ratio."""
    cells: Runs = defaultdict(dict)
    for r in sweep_runs(folders, "disk_tier"):
        if r.get("replicas", 1) != 1:
            continue
        cell = (r["traces"], r["hardware"], r["cpu_ratio"], r["programs_per_replica"])
        cells[cell][(r["policy"], r.get("disk_ratio", 0.0))] = r
    return cells


def ratio(runs: dict[tuple[str, float], dict[str, Any]], policy: str, disk: float,
          field: str = "output_tokens_per_s") -> float | None:
    """``policy`` with ``disk`` over two-tier ``mori``, in ``field`` (None: a run is
    missing or the base is 0)."""
    run, base = runs.get((policy, disk)), runs.get(("mori", 0.0))
    if run is None or base is None or not base.get(field) or run.get(field) is None:
        return None
    return float(run[field]) / float(base[field])


def _fmt(x: float | None) -> str:
    return f"{x:8.3f}" if x is not None and math.isfinite(x) else "       -"


def tables(cells: Runs) -> list[str]:
    out = []
    groups = sorted({(c[0], c[1]) for c in cells})
    for traces, preset in groups:
        here = {c: v for c, v in cells.items() if c[:2] == (traces, preset)}
        cpus = sorted({c[2] for c in here})
        progs = sorted({c[3] for c in here})
        disks = sorted({d for v in here.values() for _, d in v})
        policies = sorted({p for v in here.values() for p, _ in v},
                          key=lambda p: (p != "mori", p))
        for cpu in cpus:
            out.append(f"\n{traces}, {preset}, CPU ratio {cpu:g}: throughput / two-tier "
                       "mori (TTFT p90 ratio, disk hit %)")
            out.append("policy       disk \\ programs" + "".join(f"{n:>26}" for n in progs))
            for pol in policies:
                for d in disks:
                    row = []
                    for n in progs:
                        runs = here.get((traces, preset, cpu, n), {})
                        t = ratio(runs, pol, d)
                        p90 = ratio(runs, pol, d, "ttft_p90_s")
                        run = runs.get((pol, d))
                        hit = (f"{100 * run['disk_hit_rate']:4.1f}%"
                               if run is not None and run.get("disk_hit_rate") is not None
                               else "    -")
                        row.append(f"{_fmt(t)} ({_fmt(p90).strip():>6}, {hit})")
                    out.append(f"{pol:<12} {d:>16g}" + "".join(f"{x:>26}" for x in row))
    return out


def target(cells: Runs, preset: str, cpu: float, programs: int) -> list[str]:
    """The issue's target: ``mori`` with a disk over two-tier ``mori`` at one cell."""
    out = [f"\ntarget cell ({preset}, CPU ratio {cpu:g}, {programs} programs): mori with a "
           "disk tier / two-tier mori"]
    for (traces, hw, c, n), runs in sorted(cells.items()):
        if (hw, c, n) != (preset, cpu, programs):
            continue
        for d in sorted({d for p, d in runs if p == "mori" and d}):
            r = ratio(runs, "mori", d)
            out.append(f"  {traces}: disk ratio {d:g}: {_fmt(r).strip()}")
    return out


def plot(cells: Runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    rows = sorted({(c[0], c[1]) for c in cells})
    cpus = sorted({c[2] for c in cells})
    progs = sorted({c[3] for c in cells})
    disks = sorted({d for v in cells.values() for p, d in v if p == "mori"})
    fig, axes = plt.subplots(len(rows), len(cpus), figsize=(4.2 * len(cpus), 3.2 * len(rows)),
                             squeeze=False)
    for i, (traces, preset) in enumerate(rows):
        for j, cpu in enumerate(cpus):
            ax = axes[i][j]
            grid = [[ratio(cells.get((traces, preset, cpu, n), {}), "mori", d) or math.nan
                     for n in progs] for d in disks]
            ax.imshow(grid, cmap="RdYlGn", aspect="auto", origin="lower",
                      norm=TwoSlopeNorm(vmin=0.8, vcenter=1.0, vmax=1.5))
            for y, line in enumerate(grid):
                for x, v in enumerate(line):
                    if math.isfinite(v):
                        ax.text(x, y, f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(progs)), [str(n) for n in progs])
            ax.set_yticks(range(len(disks)), [f"{d:g}" for d in disks])
            ax.set_xlabel("programs per replica")
            ax.set_ylabel("disk ratio (x GPU pool)")
            ax.set_title(f"{traces}\n{preset}, CPU {cpu:g}", fontsize=9)
    fig.suptitle("mori with a disk tier: throughput / two-tier mori", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="mori sweep disk output folders")
    ap.add_argument("--plot", type=Path, help="draw mori's throughput ratios (PNG)")
    ap.add_argument("--target", default="b200-llama3.1-70b-tp2,1,160",
                    help="PRESET,CPU,PROGRAMS of the target cell (default: %(default)s)")
    a = ap.parse_args()
    cells = load(a.folders)
    if not cells:
        sys.exit("disk_tier: no run at DP=1 in the folders")
    print("\n".join(tables(cells)))
    preset, cpu, programs = a.target.split(",")
    print("\n".join(target(cells, preset, float(cpu), int(programs))))
    if a.plot is not None:
        plot(cells, a.plot)
        print(f"\nwrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
