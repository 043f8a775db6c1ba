"""Render one-replica runs as Markdown tables (one per preset), as in docs/results.md.

Reads a `mori simulate --json` file (a list of runs) or a `mori sweep` output
`sweep.json` (an object whose `runs` it takes; runs at several replicas are skipped).

    python scripts/results_table.py results/sweep.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

SHORT = {"smg": "SMG", "thunderagent": "TA", "thunderagent+offload": "TA+O", "mori": "MORI"}


def main(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    runs = data["runs"] if isinstance(data, dict) else data
    runs = [r for r in runs if r.get("replicas", 1) == 1]
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
    main(sys.argv[1])
