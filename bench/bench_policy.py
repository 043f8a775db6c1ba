"""Policy decision time against the number of programs (100, 1,000, 10,000).

Builds a policy holding N programs with histories, all in tool calls (about 10% of their
KV fits the GPU tier, 10% the CPU tier, the rest waits), then times ``decide()`` right
after one request arrives for a program that is not GPU-resident, so every timed
decision has to promote and demote (and rank the GPU's programs to choose whom).
Between timed calls the harness touches only the programs it acts on (it keeps the ids
the decisions forwarded): a scan of every program there would push the policy's working
set out of the caches, more so the more programs there are. Reports p50 / p99 in
milliseconds and, as a ratio, the time per program against the 100-program case
measured in the same run.

    python bench/bench_policy.py [--sizes 100,1000,10000] [--trials 200]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from mori.core.decisions import Forward
from mori.core.events import RequestArrived, StepFinished
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES
from mori.core.policy import PolicyConfig
from mori.core.types import Status, Tier


def build(policy: str, n: int, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    sizes = [rng.randint(20_000, 120_000) for _ in range(n)]
    gpu = sum(sizes) // 10
    pol = POLICIES.get(policy)(ClusterSpec(1, gpu, gpu), 1, PolicyConfig(page_tokens=1))
    running: set[str] = set()  # forwarded and not finished: kept from the decisions
    now = 0.0
    for i, s in enumerate(sizes):  # each program arrives, runs one step, goes acting
        now += 0.01
        pol.observe(RequestArrived(f"p{i}", s), now)
        _track(pol.decide(now), running)
        _finish_running(pol, running, now + 0.005)
    for _ in range(2):  # more history: tool call, return, step (untimed setup)
        for pid, p in list(pol.programs.items()):
            now += 0.01
            if p.status is Status.ACTING and rng.random() < 0.5:
                pol.observe(RequestArrived(pid, p.tokens + rng.randint(100, 2000)), now)
                _track(pol.decide(now), running)
                _finish_running(pol, running, now + 0.005)
    return pol, now, rng, running


def _track(decisions, running: set[str]) -> None:  # type: ignore[no-untyped-def]
    running.update(d.program_id for d in decisions if isinstance(d, Forward))


def _finish_running(pol, running: set[str], now: float) -> None:  # type: ignore[no-untyped-def]
    """Finish every running step. Only the programs the decisions forwarded are
    touched: a scan of every program here, between timed calls, would evict the
    policy's working set from the caches, more so the more programs there are."""
    while running:
        for pid in sorted(running):
            pol.observe(StepFinished(pid, pol.programs[pid].tokens + 100), now)
        running.clear()
        _track(pol.decide(now), running)


def _pick(pol, ids: list[str], rng: random.Random):  # type: ignore[no-untyped-def]
    """A random program in a tool call and not GPU-resident (O(1) expected: about 90%
    of programs are)."""
    for _ in range(1000):
        p = pol.programs[rng.choice(ids)]
        if p.status is Status.ACTING and p.tier is not Tier.GPU:
            return p
    return None


def measure(policy: str, n: int, trials: int) -> list[float]:
    pol, now, rng, running = build(policy, n)
    ids = list(pol.programs)
    times = []
    for _ in range(trials):
        p = _pick(pol, ids, rng)
        if p is None:
            break
        now += rng.uniform(0.1, 2.0)
        pol.observe(RequestArrived(p.program_id, p.tokens + 500), now)
        t0 = time.perf_counter()
        decisions = pol.decide(now)
        times.append(time.perf_counter() - t0)
        _track(decisions, running)
        _finish_running(pol, running, now)  # let the step finish (untimed)
    pol.check_integrity()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--policy", default="mori")
    args = ap.parse_args()
    base = None
    print(f"policy {args.policy}: decide() after one arrival")
    print(f"{'programs':>9} {'p50 ms':>8} {'p99 ms':>8} {'us/program':>11} {'vs 100':>7}")
    for n in (int(x) for x in args.sizes.split(",")):
        ts = sorted(measure(args.policy, n, args.trials))
        p50 = statistics.median(ts)
        p99 = ts[min(len(ts) - 1, int(0.99 * len(ts)))]
        per = p50 / n
        base = base or per
        print(f"{n:>9} {p50 * 1e3:>8.3f} {p99 * 1e3:>8.3f} {per * 1e6:>11.3f} {per / base:>7.2f}")


if __name__ == "__main__":
    main()
