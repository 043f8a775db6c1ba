"""Render runs as Markdown tables (one per preset), as in docs/results.md.

Reads a `mori simulate --json` file (a list of runs) or a `mori sweep` output
`sweep.json` (an object whose `runs` it takes). By default the one-replica runs, one
column per policy; with `--replicas N` the runs at N replicas, one row per policy with
the per-replica figures ("Three replicas (data parallel)").

    python scripts/results_table.py results/sweep.json
    python scripts/results_table.py results/sweep.json --replicas 3
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any

SHORT = {"smg": "SMG", "thunderagent": "TA", "thunderagent+offload": "TA+O", "mori": "MORI"}


def load(path: str, replicas: int) -> list[dict[str, Any]]:
    with open(path) as f:
        data = json.load(f)
    runs = data["runs"] if isinstance(data, dict) else data
    return [r for r in runs if r.get("replicas", 1) == replicas]


def per_replica(path: str, replicas: int) -> None:
    """One row per (preset, CPU ratio, programs per replica, policy)."""
    runs = load(path, replicas)
    order = {p: i for i, p in enumerate(SHORT)}
    runs = [r for r in runs if r["policy"] in SHORT]
    runs.sort(key=lambda r: (r["hardware"], r["cpu_ratio"], r["programs_per_replica"],
                             order[r["policy"]]))
    for hw in dict.fromkeys(r["hardware"] for r in runs):
        print(f"\n`{hw}`, DP={replicas}\n")
        print("| CPU | programs / replica | policy | tok/s | TTFT mean / p90 (s) | GPU busy % "
              "per replica | running requests per replica | programs that switched | "
              "switches / program | recomputed after a switch (M tokens) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in runs:
            if r["hardware"] != hw:
                continue
            busy = " / ".join(f"{100 * x:.0f}" for x in r["gpu_busy_frac_per_replica"])
            running = " / ".join(f"{x:.1f}" for x in r["running_requests_per_replica"])
            print(f"| {r['cpu_ratio']:g}x | {r['programs_per_replica']} | "
                  f"{SHORT[r['policy']]} | {r['output_tokens_per_s']:.0f} | "
                  f"{r['ttft_mean_s']:.1f} / {r['ttft_p90_s']:.1f} | {busy} | {running} | "
                  f"{100 * r['churn_programs_frac']:.1f}% | {r['switches_per_program']:.2f} | "
                  f"{r['switch_recomputed_tokens'] / 1e6:.1f} |")


def main(path: str) -> None:
    runs = load(path, 1)
    by: dict[tuple[str, float, int], dict[str, dict[str, float]]] = defaultdict(dict)
    for r in runs:
        by[(r["hardware"], r["cpu_ratio"], r["programs"])][r["policy"]] = r
    for hw in dict.fromkeys(r["hardware"] for r in runs):
        print(f"\n`{hw}`\n")
        pols = [p for p in SHORT if any(p in v for k, v in by.items() if k[0] == hw)]
        head = ["CPU", "programs"] + [f"{SHORT[p]} tok/s" for p in pols] + \
               [f"{SHORT[p]} TTFT mean / p90 (s)" for p in pols] + ["MORI vs TA+O tok/s"]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for (h, cpu, n), row in sorted(by.items()):
            if h != hw:
                continue
            cells = [f"{cpu:g}x", str(n)]
            cells += [f"{row[p]['output_tokens_per_s']:.0f}" for p in pols]
            cells += [f"{row[p]['ttft_mean_s']:.1f} / {row[p]['ttft_p90_s']:.1f}" for p in pols]
            if "mori" in row and "thunderagent+offload" in row:
                gain = row["mori"]["output_tokens_per_s"] / \
                    row["thunderagent+offload"]["output_tokens_per_s"] - 1
                cells.append(f"{gain:+.0%}")
            else:
                cells.append("")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a mori simulate --json file or a mori sweep's sweep.json")
    ap.add_argument("--replicas", type=int, default=1,
                    help="the runs at this many replicas (default 1: one column a policy)")
    a = ap.parse_args()
    if a.replicas == 1:
        main(a.path)
    else:
        per_replica(a.path, a.replicas)
