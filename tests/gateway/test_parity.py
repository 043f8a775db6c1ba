"""Parity: one small trace through the simulator and through ``mori replay`` against
``mori serve`` with time-scaled simulated engines gives the same placement decisions.

The two worlds run the same policy on the same capacities; what differs is that the live
one runs on wall-clock time, so event times carry a few milliseconds of jitter (times
the time scale in policy seconds). The trace is built so that no two events that
matter to the policy are closer than that: programs start seconds apart and their tool
gaps differ by seconds. The tolerance is then: the same decisions, per program in the
same order, and globally in the same order except for decisions taken at the same
instant; times agree within ``TIME_TOL_S`` policy seconds.

That the trace has such room is checked, not assumed: the simulator takes the same
decisions with its engine up to ``SLACK`` faster or slower, which moves every step's end
by seconds against the tool calls around it (a CI run failed when one program's step
ended 1.6 policy seconds before another's request needed room, with the trace this test
had before).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway_harness import LoopThread

from mori.core.decision_log import DecisionLog, DecisionRecord
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig, start_simulated_backends, tune_gc
from mori.replay import ReplayConfig, replay
from mori.sim.config import SimConfig
from mori.sim.runner import Simulation
from mori.traces.model import GapKind, ProgramTrace, Step, TraceSet

PRESET = "b200-llama3.1-70b-tp2"  # 570,240 tokens of GPU KV, 131,072-token context
PROGRAMS = 6
DURATION_S = 150.0
TIME_SCALE = 10.0
SEED = 4
STAGGER_S = 60.0
TIME_TOL_S = 3.0
SLACK = 0.15


def parity_traces() -> TraceSet:
    progs = []
    for i in range(PROGRAMS):
        steps = []
        prompt = 60_000 + 8_000 * i
        for k in range(3):
            last = k == 2
            steps.append(Step(prompt_tokens=prompt, output_tokens=200,
                              gap_s=0.0 if last else 25.0 + 10.0 * i,
                              gap_kind=GapKind.END if last else GapKind.TOOL,
                              reuse_tokens=0 if k == 0 else prompt - 15_000 + 200))
            prompt += 15_000 + 200
        progs.append(ProgramTrace(f"p{i}", tuple(steps)))
    return TraceSet("parity", tuple(progs))


def simulated_decisions(traces: TraceSet, slowdown: float = 1.0) -> DecisionLog:
    log = DecisionLog()
    Simulation(SimConfig(policy="mori", programs=PROGRAMS, hardware=PRESET, cpu_ratio=1.0,
                         duration_s=DURATION_S, seed=SEED, stagger_s=STAGGER_S,
                         engine_slowdown=slowdown),
               traces, log=log).run()
    return log


@contextmanager
def collector_as_in_mori_serve() -> Iterator[None]:
    """``mori serve`` freezes what its startup allocated and makes collections rarer
    (``tune_gc``). This test's process instead holds whatever earlier tests left, and one
    full collection over that heap stalls the live run for tenths of a second: seconds
    of policy time at ``TIME_SCALE`` (a CI run failed the time check by 4.7 s with every
    decision the same). So the live run gets the collector ``mori serve`` has."""
    old = gc.get_threshold()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)


def live_decisions(lt: LoopThread, traces: TraceSet) -> DecisionLog:
    settings = GatewaySettings(policy="mori", time_scale=TIME_SCALE)
    cfg = ServeConfig(replicas=1, preset=PRESET, cpu_ratio=1.0, settings=settings)
    adapters, handles = lt.call(start_simulated_backends(cfg))
    lt.handles.extend(handles)
    app = create_app(settings, adapters)
    url = lt.serve(app).url
    result = asyncio.run(replay(ReplayConfig(
        target=url, programs=PROGRAMS, duration_s=DURATION_S, time_scale=TIME_SCALE,
        seed=SEED, stagger_s=STAGGER_S), traces))
    assert result.errors == {} or sum(result.errors.values()) == 0, result.errors
    log: DecisionLog = app.state.gateway.ctl.log
    return log


def aligned(log: DecisionLog, until: float) -> list[DecisionRecord]:
    """Times from the first decision (the first program's start) on, cut at ``until``
    (leaving out the releases of programs cut off by the end of the run)."""
    records = list(log)
    t0 = records[0].time
    return [DecisionRecord(r.time - t0, r.decision) for r in records if r.time - t0 <= until]


def key(r: DecisionRecord) -> tuple[Any, ...]:
    return (r.kind, r.decision.program_id, repr(r.decision))


def per_program(records: list[DecisionRecord]) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    for d in records:
        out.setdefault(d.decision.program_id, []).append(key(d))
    return out


def test_the_trace_leaves_room_for_the_jitter_of_real_time() -> None:
    traces = parity_traces()
    until = DURATION_S - 20.0
    base = per_program(aligned(simulated_decisions(traces), until))
    for slowdown in (1.0 - SLACK, 1.0 - SLACK / 2, 1.0 + SLACK / 2, 1.0 + SLACK):
        moved = per_program(aligned(simulated_decisions(traces, slowdown), until))
        assert moved == base, slowdown


def test_simulator_and_live_gateway_take_the_same_decisions(loop_thread: LoopThread) -> None:
    traces = parity_traces()
    sim = simulated_decisions(traces)
    with collector_as_in_mori_serve():
        live = live_decisions(loop_thread, traces)
    until = DURATION_S - 20.0  # well inside both runs
    a, b = aligned(sim, until), aligned(live, until)
    assert len(a) >= 20
    assert any(d.kind == "demote" for d in a)  # the trace exceeds the GPU tier
    # the same decisions, per program in the same order
    assert per_program(a) == per_program(b)
    # globally in the same order, up to decisions taken at the same instant
    assert sorted(map(key, a)) == sorted(map(key, b))
    for da, db in zip(a, b, strict=True):
        if key(da) != key(db):
            near = [d for d in a if abs(d.time - da.time) < 1e-9]
            assert key(db) in map(key, near), (da, db)
    # and at the same times, within the jitter of real time
    worst = max(abs(da.time - db.time) for da, db in
                zip(sorted(a, key=key), sorted(b, key=key), strict=True))
    assert worst < TIME_TOL_S, worst
