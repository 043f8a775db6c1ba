"""Why ThunderAgent switches programs between replicas: its pauses and resumes, counted.

Runs ``thunderagent`` or ``thunderagent+offload`` in the simulator on several replicas
and counts, from the policy's own calls, every pause and every resume, split by where
the resumed program goes: the backend it was paused from, another one, or (a new
program) wherever it is first placed. The figures in docs/results.md's "Three replicas"
section come from

    python bench/ta_churn.py --programs 20,80 --cpu-ratio 1

It reads the policy without changing a decision (the counters wrap two methods of the
one policy object of each run).
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from mori.core.policies.thunderagent import ThunderAgentPolicy
from mori.sim.config import SimConfig
from mori.sim.runner import Simulation
from mori.traces import default_traces, load_traces


def count(sim: Simulation) -> Counter[str]:
    """Wrap the policy's pause and resume to count them (kinds as docs/results.md names them)."""
    policy = sim.policy
    assert isinstance(policy, ThunderAgentPolicy), "a thunderagent policy is needed"
    seen: Counter[str] = Counter()
    pause, resume = policy._pause, policy._resume

    def counted_pause(p: Any, out: Any) -> None:
        seen["pauses"] += 1
        pause(p, out)

    def counted_resume(p: Any, r: int, now: float, out: Any) -> None:
        info = policy.paused.get(p.program_id)
        if info is None or info.origin is None:
            seen["first placements"] += 1
        elif info.origin == r:
            seen["resumed on the same backend"] += 1
        else:
            seen["resumed on another backend"] += 1
        resume(p, r, now, out)

    policy._pause = counted_pause  # type: ignore[method-assign]
    policy._resume = counted_resume  # type: ignore[method-assign]
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="thunderagent+offload")
    ap.add_argument("--programs", default="20,80", help="programs per replica, comma-separated")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--cpu-ratio", type=float, default=1.0)
    ap.add_argument("--preset", default="h200-qwen3-30b-a3b")
    ap.add_argument("--traces", default=None, help="a trace file (default: the shipped set)")
    args = ap.parse_args()
    traces = load_traces(args.traces) if args.traces else default_traces()
    for n in (int(x) for x in args.programs.split(",")):
        sim = Simulation(SimConfig(policy=args.policy, programs=n * args.replicas,
                                   replicas=args.replicas, hardware=args.preset,
                                   cpu_ratio=args.cpu_ratio), traces)
        seen = count(sim)
        r = sim.run()
        resumed = seen["resumed on the same backend"] + seen["resumed on another backend"]
        away = seen["resumed on another backend"] / resumed if resumed else 0.0
        busy = " / ".join(f"{100 * b:.0f}" for b in r.gpu_busy_frac_per_replica)
        print(f"{n} programs per replica: {seen['pauses']} pauses, {resumed} resumes of "
              f"paused programs, {seen['resumed on another backend']} ({100 * away:.0f}%) "
              f"on another backend, {seen['first placements']} first placements; "
              f"programs that switched {100 * r.churn_programs_frac:.1f}%, "
              f"GPU busy {busy} %")


if __name__ == "__main__":
    main()
