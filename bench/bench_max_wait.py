"""What bounded waiting (``--max-wait``) costs and buys MORI, against TA+O in the same run.

For each setting (preset, CPU ratio, programs), runs ``thunderagent+offload`` once and
``mori`` at every bound, and prints throughput (and its ratio to ``mori`` without a
bound), the TTFT percentiles of answered requests, how many requests were still
unanswered at the end, the longest such wait, and the p99 with those waits counted
(``ttft_p99_with_waiting_s``: the tail the end of the run hides). The README's
"Bounded waiting" table comes from

    python bench/bench_max_wait.py --jobs 2

All runs are simulated hours (``--duration``); a bound of 0 is the paper's rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from mori.cli.simulate_cmd import run_grid
from mori.core.policy import PolicyConfig
from mori.sim.config import SimConfig
from mori.sim.metrics import RunResult
from mori.traces import default_traces, load_traces

SETTINGS = [("h200-qwen3-30b-a3b", 1.0, 50), ("h200-qwen3-30b-a3b", 1.0, 80),
            ("h200-qwen3-30b-a3b", 2.0, 80), ("h200-80g-qwen2.5-7b", 1.0, 80),
            ("b200-llama3.1-70b-tp2", 1.0, 80)]
BOUNDS = (0.0, 600.0, 1200.0, 1800.0, 3600.0)


def _csv(kind: type, text: str) -> list:
    return [kind(t) for t in text.split(",") if t.strip()]


def configs(settings: list[tuple[str, float, int]], bounds: list[float], replicas: int,
            duration: float, seed: int) -> list[SimConfig]:
    out = []
    for hw, cpu, n in settings:
        base = SimConfig(policy="thunderagent+offload", programs=n * replicas, hardware=hw,
                         cpu_ratio=cpu, replicas=replicas, duration_s=duration, seed=seed)
        out.append(base)
        out += [dataclasses.replace(base, policy="mori",
                                    policy_config=PolicyConfig(max_wait_s=b or None))
                for b in bounds]
    return out


def table(results: list[RunResult]) -> str:
    head = ("| preset | CPU | programs | policy | bound (s) | tok/s | vs no bound | "
            "TTFT p90 (s) | p99 (s) | unanswered at end | longest wait (s) | "
            "p99 with waits (s) |")
    lines = [head, "|" + "---|" * 12]
    plain: dict[tuple[str, float, int], float] = {}
    for r in results:
        c = r.config
        key = (c.hardware, c.cpu_ratio, c.programs)
        bound = c.policy_config.max_wait_s
        if c.policy == "mori" and bound is None:
            plain[key] = r.output_tokens_per_s
        vs = (f"{r.output_tokens_per_s / plain[key]:.3f}"
              if c.policy == "mori" and key in plain else "")
        lines.append(
            f"| {c.hardware} | {c.cpu_ratio:g}x | {c.programs} | {c.policy} | "
            f"{'' if c.policy != 'mori' else 'none' if bound is None else f'{bound:g}'} | "
            f"{r.output_tokens_per_s:.1f} | {vs} | {r.ttft_p90_s:.1f} | {r.ttft_p99_s:.1f} | "
            f"{r.requests_waiting_at_end} | {r.wait_max_at_end_s:.0f} | "
            f"{r.ttft_p99_with_waiting_s:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bounds", default=",".join(f"{b:g}" for b in BOUNDS),
                    help="bounds in seconds, comma-separated; 0: none (default: %(default)s)")
    ap.add_argument("--settings", default=None,
                    help="PRESET:CPU:PROGRAMS,... (default: the five of docs/results.md)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--duration", type=float, default=3600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", default=None, help="trace set (default: the shipped one)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    a = ap.parse_args()
    settings = SETTINGS
    if a.settings:
        settings = []
        for item in a.settings.split(","):
            hw, cpu, n = item.split(":")
            settings.append((hw, float(cpu), int(n)))
    traces = load_traces(a.traces) if a.traces else default_traces()
    grid = configs(settings, _csv(float, a.bounds), a.replicas, a.duration, a.seed)
    outcomes = run_grid(grid, traces, min(a.jobs, len(grid)), a.quiet, None)
    print(table([result for result, _ in outcomes]))


if __name__ == "__main__":
    main()
