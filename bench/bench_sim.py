"""Simulator speed and memory: N programs on R replicas over one simulated hour.

Each run happens in a fresh Python process so its peak resident memory can be read
(``ru_maxrss`` of the child). Reports wall seconds, simulated seconds per wall second
and peak RSS per policy, and the wall time as a ratio against the first policy listed
(by default ``smg``, the policy with the least work: no scheduling) measured in the same
invocation, since these machines are shared and noisy. A second figure, ``import``, is the bare interpreter + package import
cost included in every run.

    python bench/bench_sim.py [--programs 80] [--replicas 1] [--cpu-ratio 1]
                              [--duration 3600] [--policies smg,mori,...] [--repeat 1]

``--repeat N`` runs every policy N times, in rounds (each round runs the policies in
turn, so that a slow spell of the machine falls on all of them) and reports the median
wall time of each, and its ratio against the first policy's median.

``--programs`` is the total over all replicas (the fleet target: ``--programs 10000
--replicas 128``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from mori.sim.config import SimConfig
from mori.sim.runner import simulate
from mori.traces import default_traces
cfg = SimConfig(policy=sys.argv[1], programs=int(sys.argv[2]), duration_s=float(sys.argv[3]),
                hardware=sys.argv[4], replicas=int(sys.argv[5]), cpu_ratio=float(sys.argv[6]))
r = simulate(cfg, default_traces())
print(json.dumps({"wall": r.wall_s, "steps": r.steps, "events": r.events,
                  "total": time.perf_counter() - t0,
                  "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def run_child(args: list[str]) -> tuple[dict[str, float], float]:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], check=True,
                         capture_output=True, text=True).stdout
    res = json.loads(out)
    return res, res["rss_kib"] / 1024.0  # the child's own peak (KiB on Linux)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=80)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--cpu-ratio", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--preset", default="h200-qwen3-30b-a3b")
    ap.add_argument("--policies", default="smg,thunderagent,thunderagent+offload,mori")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of each policy, in alternating rounds; the median is shown")
    args = ap.parse_args()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import mori.sim.runner, mori.traces"], check=True)
    imp = time.perf_counter() - t0
    print(f"{args.programs} programs on {args.replicas} replicas (cpu ratio {args.cpu_ratio:g}), "
          f"{args.duration:.0f} simulated s on {args.preset}")
    print(f"bare import of the package in a fresh process: {imp:.2f} s")
    policies = args.policies.split(",")
    runs: dict[str, list[tuple[dict[str, float], float]]] = {pol: [] for pol in policies}
    for i in range(max(1, args.repeat)):
        for pol in policies:
            runs[pol].append(run_child([pol, str(args.programs), str(args.duration),
                                        args.preset, str(args.replicas), str(args.cpu_ratio)]))
            if args.repeat > 1:
                print(f"  round {i + 1}: {pol} {runs[pol][-1][0]['wall']:.2f} s", flush=True)
    print(f"{'policy':<22} {'sim wall s':>10} {'sim s/wall s':>13} {'events':>8} "
          f"{'peak RSS MiB':>13} {'wall vs ' + args.policies.split(',')[0]:>12}")
    base = statistics.median(res["wall"] for res, _ in runs[policies[0]])
    for pol in policies:
        wall = statistics.median(res["wall"] for res, _ in runs[pol])
        res, rss = runs[pol][0]
        print(f"{pol:<22} {wall:>10.2f} {args.duration / wall:>13.0f} "
              f"{int(res['events']):>8} {max(r for _, r in runs[pol]):>13.0f} {wall / base:>12.2f}")


if __name__ == "__main__":
    main()
