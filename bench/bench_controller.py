"""The live gateway's controller: CPU cost per event at 1,000 and 10,000 programs, or
with up to 100,000 idle programs beside a fixed active set (``--idle``).

The real ``Controller`` (``mori.gateway.control``) with the real policy and decision
executor, a fake clock and in-memory engine adapters that accept every KV control (no
HTTP, no engine). A closed loop of programs (80 per replica, as the ``fleet`` sweep):
each sends a request, waits until the policy forwards it, "runs" for a few seconds of
fake time, then spends a tool call of fake time before its next request. Every event
the controller sees (an arrival through ``admit``, a step's end through ``finished``)
is timed, including the scheduling of the asyncio tasks it wakes and the KV controls
it queues. The garbage collector is set as ``mori serve`` sets it once started
(``mori.gateway.server.tune_gc``; ``--python-gc`` keeps Python's defaults). Only
pending tasks are kept, as a server holds them. Reports per-event p50 / p99 / mean in
microseconds, and the mean against the smallest size measured in the same run.

``--idle 1000,10000,100000`` keeps the replicas and the active loop fixed (``--active``
programs, 80 per replica) and adds that many idle programs first: each sends one
request, runs its step and never returns (a client that went away; the gateway's idle
timeout is off). The active loop starts once every idle program has made its step,
and its events are timed from 240 s of fake time later, once it has pushed the idle programs
out of the GPU and CPU tiers (the steady state, the same whatever their number); the
mean is compared against the first count. This is how the gateway's per-event cost is
checked to stay flat as programs accumulate.

    python bench/bench_controller.py [--sizes 1000,10000] [--events 20000] [--policy mori]
                                     [--python-gc]
    python bench/bench_controller.py --idle 1000,10000,100000 [--active 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import heapq
import math
import pstats
import random
import statistics
import time
from typing import Any

from mori.engines.base import EngineAdapter, KVCapacity, RequestHints, UpstreamResponse
from mori.gateway.app import policy_for
from mori.gateway.config import GatewaySettings
from mori.gateway.control import Controller
from mori.gateway.metrics import GatewayMetrics
from mori.gateway.server import tune_gc

PER_REPLICA = 80
GPU_TOKENS = 1_000_000  # per replica; programs of 20k-120k tokens: ~15 fit a GPU
CPU_TOKENS = 2 * GPU_TOKENS


class NullAdapter(EngineAdapter):
    """An engine replica that accepts every KV control and forwards nothing."""

    kind = "null"

    def __init__(self) -> None:
        super().__init__("memory://null")

    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        return UpstreamResponse(200, {}, body=b"{}")

    async def capacity(self) -> KVCapacity:
        return KVCapacity(GPU_TOKENS, CPU_TOKENS, 16, 1)

    async def health(self) -> bool:
        return True

    async def models(self) -> list[dict[str, Any]]:
        return [{"id": "m"}]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def measure(policy: str, programs: int, events: int, seed: int = 0,
                  serve_gc: bool = True, idle: int = 0,
                  profiler: cProfile.Profile | None = None) -> list[float]:
    """Per-event times of ``programs`` programs in a closed loop; with ``idle``, that
    many more programs make one step each before the timed events and never return."""
    rng = random.Random(seed)
    replicas = max(1, programs // PER_REPLICA)
    adapters: list[EngineAdapter] = [NullAdapter() for _ in range(replicas)]
    settings = GatewaySettings(policy=policy, max_held=10 * (programs + idle),
                               program_ttl_s=0.0)
    clock = Clock()
    caps = [KVCapacity(GPU_TOKENS, CPU_TOKENS, 16, 1)] * replicas
    ctl = Controller(policy_for(settings, caps), adapters, GatewayMetrics(), settings,
                     clock=clock)
    tokens = {f"p{i}": rng.randint(20_000, 60_000) for i in range(programs)}
    defaults = gc.get_threshold()
    if serve_gc:  # what ``mori serve`` does once started (GC_THRESHOLDS)
        tune_gc()
    heap: list[tuple[float, int, str, str]] = []
    seq = 0

    def at(t: float, kind: str, pid: str) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, pid))

    def admitted(pid: str, task: asyncio.Task[Any]) -> None:
        tasks.discard(task)  # only pending tasks are kept (as a server holds them)
        if not task.cancelled() and task.exception() is None:
            at(clock.t + rng.uniform(1.0, 8.0), "finish", pid)

    start = 0.0 if not idle else math.inf  # events are timed from then on
    idle_left = idle
    for i in range(idle):  # they arrive first, each runs one step and goes away
        tokens[f"idle{i}"] = rng.randint(20_000, 60_000)
        at(rng.uniform(0.0, 30.0), "arrive", f"idle{i}")

    def start_active(t0: float) -> None:
        for pid in tokens:
            if not pid.startswith("idle"):
                at(t0 + rng.uniform(0.0, 60.0), "arrive", pid)

    if not idle:
        start_active(0.0)
    times: list[float] = []
    tasks: set[asyncio.Task[Any]] = set()
    try:
        while heap and len(times) < events:
            t, _, kind, pid = heapq.heappop(heap)
            clock.t = t
            t0 = time.perf_counter()
            if kind == "arrive":
                task = asyncio.get_running_loop().create_task(ctl.admit(pid, tokens[pid]))
                task.add_done_callback(lambda tk, pid=pid: admitted(pid, tk))
                tasks.add(task)
            else:
                tokens[pid] += rng.randint(200, 2_000)
                ctl.finished(pid, tokens[pid])
                if not pid.startswith("idle"):
                    at(t + rng.expovariate(1 / 20.0), "arrive", pid)
                else:
                    idle_left -= 1
                    if not idle_left:  # the active loop starts, and is timed once it
                        # has pushed the idle programs out of the tiers
                        start_active(t)
                        start = t + 240.0
            await asyncio.sleep(0)  # the tasks this event woke run, and queue their work
            if t >= start:
                times.append(time.perf_counter() - t0)
                if profiler is not None and len(times) == 1:
                    profiler.enable()  # from the second timed event on
        if profiler is not None:
            profiler.disable()
        ctl.policy.check_integrity()
    finally:
        await ctl.stop()  # held requests are rejected: collect their tasks quietly
        await asyncio.gather(*tasks, return_exceptions=True)
        if serve_gc:
            gc.unfreeze()
            gc.set_threshold(*defaults)
    return times[min(len(times) // 10, 2 * programs):]  # leave out the start-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--policy", default="mori")
    ap.add_argument("--python-gc", action="store_true",
                    help="keep Python's collector defaults instead of mori serve's")
    ap.add_argument("--idle", default="",
                    help="idle program counts (e.g. 1000,10000,100000) beside a fixed "
                         "active loop; --sizes is then not used")
    ap.add_argument("--profile", action="store_true",
                    help="with --idle: print the functions taking the most time in the "
                         "timed events of each count (cProfile; the times it prints are "
                         "inflated by the profiler)")
    ap.add_argument("--active", type=int, default=1000,
                    help="programs in the closed loop with --idle (80 per replica)")
    args = ap.parse_args()
    if args.idle:
        n = args.active
        print(f"policy {args.policy}: controller cost per event, {n} active programs on "
              f"{max(1, n // PER_REPLICA)} replicas beside idle ones (fake clock, "
              "in-memory adapters)")
        print(f"{'idle':>9} {'events':>7} {'p50 us':>8} {'p99 us':>8} {'mean us':>8} "
              f"{'vs first':>9}")
        first = None
        for k in (int(x) for x in args.idle.split(",")):
            prof = cProfile.Profile() if args.profile else None
            ts = sorted(asyncio.run(measure(args.policy, n, args.events + 2 * n,
                                            serve_gc=not args.python_gc, idle=k,
                                            profiler=prof)))
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
            mean = statistics.fmean(ts)
            first = first or mean
            print(f"{k:>9} {len(ts):>7} {statistics.median(ts) * 1e6:>8.1f} "
                  f"{ts[int(0.99 * (len(ts) - 1))] * 1e6:>8.1f} {mean * 1e6:>8.1f} "
                  f"{mean / first:>9.2f}")
        return
    print(f"policy {args.policy}: controller cost per event ({PER_REPLICA} programs per "
          "replica, fake clock, in-memory adapters)")
    print(f"{'programs':>9} {'replicas':>9} {'events':>7} {'p50 us':>8} {'p99 us':>8} "
          f"{'mean us':>8} {'vs first':>9}")
    base = None
    for n in (int(x) for x in args.sizes.split(",")):
        ts = sorted(asyncio.run(measure(args.policy, n, args.events + 2 * n,
                                        serve_gc=not args.python_gc)))
        mean = statistics.fmean(ts)
        base = base or mean
        print(f"{n:>9} {max(1, n // PER_REPLICA):>9} {len(ts):>7} "
              f"{statistics.median(ts) * 1e6:>8.1f} {ts[int(0.99 * (len(ts) - 1))] * 1e6:>8.1f} "
              f"{mean * 1e6:>8.1f} {mean / base:>9.2f}")


if __name__ == "__main__":
    main()
