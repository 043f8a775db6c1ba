"""MORI against the best baseline in every cell of a grid: ``mori sweep never-loses``'s
table and heat map.

Reads the ``sweep.json`` of one or more ``mori sweep`` output folders (later folders'
runs replace earlier ones'), and for each cell (preset, replicas, CPU ratio, programs
per replica) divides the candidate's throughput by the best baseline's. Prints one table
per preset and replicas, the cells below 1.0, the paper settings' check against the
paper's MORI (CPU ratio 1 and 2, 50-80 programs: within 2%), and TTFT p90 where the
throughput ties (within 2%); ``--plot`` draws the ratios as a heat map.

Folders of several seeds (``mori sweep never-loses --seed N``, one folder each) are read
together: a cell's ratio is taken per seed, the tables show each cell's median over the
seeds, and the summary checks the bar of never losing: every cell's median at least
``--cell-bar`` (0.99) and no single run below ``--run-bar`` (0.95).

    mori sweep never-loses --out runs/never-loses
    python bench/never_loses.py runs/never-loses --plot docs/img/never-loses.png
    for s in 0 1 2 3 4; do mori sweep never-loses --seed $s --out runs/nl-$s; done
    python bench/never_loses.py runs/nl-0 runs/nl-1 runs/nl-2 runs/nl-3 runs/nl-4
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
Runs = dict[str, dict[str, Any]]  # policy -> run record


def load(folders: list[Path]) -> dict[int, dict[Cell, Runs]]:
    """Every run of the folders' ``sweep.json``, by seed, cell and policy (a later
    folder's run of the same seed, cell and policy replaces an earlier one's)."""
    seeds: dict[int, dict[Cell, Runs]] = defaultdict(lambda: defaultdict(dict))
    for r in sweep_runs(folders, "never_loses"):
        cell = (r["hardware"], r["replicas"], r["cpu_ratio"], r["programs_per_replica"])
        seeds[int(r.get("seed", 0))][cell][r["policy"]] = r
    return seeds


def ratios(cells: dict[Cell, Runs], candidate: str,
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


def over_seeds(by_seed: dict[int, dict[Cell, tuple[float, str]]]
               ) -> dict[Cell, tuple[float, str, float, int]]:
    """Per cell, over the seeds that ran it: the median ratio, the best baseline of the
    seed nearest that median, the lowest ratio and the number of seeds."""
    per: dict[Cell, list[tuple[float, str]]] = defaultdict(list)
    for cells in by_seed.values():
        for cell, v in cells.items():
            per[cell].append(v)
    out: dict[Cell, tuple[float, str, float, int]] = {}
    for cell, vs in per.items():
        xs = sorted(x for x, _ in vs)
        mid = len(xs) // 2
        med = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        best = min(vs, key=lambda v: abs(v[0] - med))[1]
        out[cell] = (med, best, xs[0], len(xs))
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
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 if the bar is not met")
    ap.add_argument("--cell-bar", type=float, default=0.99,
                    help="the least median ratio a cell may have (default: 0.99)")
    ap.add_argument("--run-bar", type=float, default=0.95,
                    help="the least ratio any one run may have (default: 0.95)")
    a = ap.parse_args()
    baselines = a.baselines.split(",")
    seeds = load(a.folders)
    by_seed = {seed: ratios(cells, a.policy, baselines) for seed, cells in seeds.items()}
    by_seed = {seed: r for seed, r in by_seed.items() if r}
    if not by_seed:
        sys.exit(f"never_loses: no cell has both {a.policy} and a baseline")
    agg = over_seeds(by_seed)
    r = {c: (v[0], v[1]) for c, v in agg.items()}
    several = len(by_seed) > 1
    what = f"median over seeds {','.join(map(str, sorted(by_seed)))}" if several else (
        f"seed {next(iter(by_seed))}")
    groups = sorted({(c[0], c[1]) for c in r})
    cpus = sorted({c[2] for c in r})
    progs = sorted({c[3] for c in r})
    for preset, dp in groups:
        print(f"\n{preset}, DP={dp}: {a.policy} / best of {a.baselines} ({what})")
        print("cpu \\ programs " + "".join(f"{n:>8}" for n in progs))
        for cpu in cpus:
            row = [r.get((preset, dp, cpu, n)) for n in progs]
            print(f"{cpu:<15g}" + "".join(f"{x[0]:8.3f}" if x else "       -" for x in row))
    print(f"\nby CPU ratio: min and geomean of {a.policy} (and {a.paper}) / best baseline")
    rp_seed = {seed: ratios(cells, a.paper, baselines) for seed, cells in seeds.items()}
    rp = {c: v[0] for c, v in over_seeds({s_: x for s_, x in rp_seed.items() if x}).items()}
    for cpu in cpus:
        mine = [v[0] for c, v in r.items() if c[2] == cpu]
        theirs = [v for c, v in rp.items() if c[2] == cpu]
        line = f"  cpu {cpu:<5g} {min(mine):.3f} / {_geomean(mine):.3f}"
        if theirs:
            line += f"   ({a.paper}: {min(theirs):.3f} / {_geomean(theirs):.3f})"
        print(line)
    below = sorted((v[0], c, v[1]) for c, v in r.items() if v[0] < 1.0)
    print(f"\ncells: {len(r)}; below 1.0: {len(below)}; "
          f"min {min(v[0] for v in r.values()):.3f}; geomean {_geomean([v[0] for v in r.values()]):.3f}")
    for ratio, (preset, dp, cpu, n), best in below:
        low = f"; lowest seed {agg[(preset, dp, cpu, n)][2]:.3f}" if several else ""
        print(f"  {ratio:.3f}  {preset} DP={dp} cpu {cpu:g} {n} programs (best: {best}{low})")
    runs_all = [(x[0], seed, c) for seed, rs in by_seed.items() for c, x in rs.items()]
    worst_run = min(runs_all)
    cells_under = sorted((v[0], c) for c, v in agg.items() if v[0] < a.cell_bar)
    runs_under = sorted(x for x in runs_all if x[0] < a.run_bar)
    ok = not cells_under and not runs_under
    print(f"\nthe bar ({len(runs_all)} runs of {len(by_seed)} seed(s)): every cell's median >= "
          f"{a.cell_bar}: {len(cells_under)} below; no run below {a.run_bar}: "
          f"{len(runs_under)} below (lowest {worst_run[0]:.3f}, seed {worst_run[1]}, "
          f"{worst_run[2]}): {'met' if ok else 'NOT met'}")
    for ratio, c in cells_under:
        print(f"  cell {c}: median {ratio:.3f}")
    for ratio, seed, c in runs_under:
        print(f"  run {c} seed {seed}: {ratio:.3f}")
    paper = [(c, seed, runs[a.policy]["output_tokens_per_s"] /
              runs[a.paper]["output_tokens_per_s"])
             for seed, cells in seeds.items() for c, runs in cells.items()
             if a.policy in runs and a.paper in runs
             and c[2] in (1.0, 2.0) and 50 <= c[3] <= 80]
    if paper:
        worst = min(paper, key=lambda t: t[2])
        print(f"paper settings: {a.policy} / {a.paper} min {worst[2]:.3f} at {worst[0]} "
              f"seed {worst[1]}; {sum(1 for *_, x in paper if x < 0.98)} of {len(paper)} "
              "below 0.98")
    ties = []
    for seed, rs in by_seed.items():
        for c, (ratio, best) in rs.items():
            if abs(ratio - 1.0) <= 0.02:
                mine = seeds[seed][c][a.policy]["ttft_p90_s"]
                theirs = seeds[seed][c][best]["ttft_p90_s"]
                if mine is not None and theirs is not None and mine > theirs * 1.02 + 0.05:
                    ties.append((c, seed, mine, theirs, best))
    print(f"ties (within 2%) with a worse TTFT p90: {len(ties)} of {len(runs_all)} runs")
    for c, seed, mine, theirs, best in sorted(ties):
        print(f"  {c}{f' seed {seed}' if several else ''}: {mine:.2f} s vs {best} {theirs:.2f} s")
    if a.plot:
        plot(r, groups, cpus, progs, a.policy, a.plot)
        print(f"wrote {a.plot}")
    return 0 if ok or not a.strict else 1


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
