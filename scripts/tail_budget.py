"""What a short TTFT tail would cost MORI under overload: an estimate from a sweep's counters.

Under overload MORI parks programs in the Waiting queue (no cache) and readmits them only
as fast as the tiers drop someone. To serve every parked request within ``--within`` times
the run's TTFT p90, each parked program must be readmitted that often, and each
readmission recomputes its context. For every ``mori`` run that ended with a request
waiting longer than that bound (and that dropped programs) this prints:

- parked: the requests waiting at the end of the run (taken as the parked set);
- drops/h: programs dropped from the tiers to Waiting, per hour;
- recompute %: GPU time its recomputes took, at the preset's prefill rate
  (``CostModel.prefill_rate``, a 32k-token context from nothing, one rate for all);
- bound (s): ``--within`` x p90;
- readmits/h: parked / bound, per hour;
- extra %: the GPU time of the readmissions beyond today's drops, each costing the run's
  mean recomputed tokens per drop.

It is arithmetic on the run's counters, not a simulation: it holds p90 where it is and
takes the parked set as constant. Usage:

    mori sweep paper --out out/paper
    python scripts/tail_budget.py out/paper/sweep.json [--within 4]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mori.core.costmodel import CostModel, get_preset

NEEDED = ("hardware", "cpu_ratio", "replicas", "programs_per_replica", "duration_s",
          "ttft_p90_s", "requests_waiting_at_end", "wait_max_at_end_s", "demotions_to_none",
          "recomputed_tokens")
"""The fields of a run the estimate reads."""


def rows(runs: list[dict[str, Any]], within: float) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for r in runs:
        bound = within * r["ttft_p90_s"]
        if (r["policy"] != "mori" or not r["demotions_to_none"]
                or r["wait_max_at_end_s"] <= bound):
            continue  # no request left waiting past the bound, or nobody is dropped
        hours = r["duration_s"] / 3600
        rate = CostModel(get_preset(r["hardware"])).prefill_rate() * r["replicas"]
        parked = r["requests_waiting_at_end"]
        drops = r["demotions_to_none"]
        per_drop = r["recomputed_tokens"] / drops
        readmits = parked / bound * r["duration_s"]
        extra = max(0.0, readmits - drops) * per_drop / rate / r["duration_s"]
        out.append((r["hardware"], f"{r['cpu_ratio']:g}x", str(r["replicas"]),
                    str(r["programs_per_replica"]), str(parked), f"{drops / hours:.0f}",
                    f"{100 * r['recomputed_tokens'] / rate / r['duration_s']:.1f}",
                    f"{bound:.0f}", f"{readmits / hours:.0f}", f"{100 * extra:.1f}"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", help="a `mori sweep` sweep.json, or a `mori simulate --json` file")
    ap.add_argument("--within", type=float, default=4.0,
                    help="the bound on a parked request's wait, in multiples of p90 (default 4)")
    args = ap.parse_args(argv)
    try:
        with open(args.sweep) as f:
            data = json.load(f)
    except OSError as e:
        ap.error(f"cannot read {args.sweep}: {e.strerror}")
    except json.JSONDecodeError as e:
        ap.error(f"{args.sweep}: not JSON (line {e.lineno}, column {e.colno}: {e.msg})")
    runs = data.get("runs") if isinstance(data, dict) else data
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        ap.error(f"{args.sweep}: expected a sweep.json (an object with 'runs') or a list of "
                 "runs from `mori simulate --json`")
    missing = sorted({k for r in runs if r.get("policy") == "mori" for k in NEEDED
                      if k not in r})
    if missing:
        ap.error(f"{args.sweep}: its mori runs lack {', '.join(missing)}; rerun the sweep "
                 "with this version of mori (`mori sweep ... --fresh`)")
    head = ("preset", "CPU", "DP", "programs / replica", "parked", "drops/h", "recompute %",
            "bound (s)", "readmits/h", "extra %")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows(runs, args.within):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
