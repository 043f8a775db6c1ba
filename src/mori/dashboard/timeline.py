"""``mori simulate --timeline``: the dashboard's view of a simulated run, in one file.

``TimelineRecorder`` watches a ``Simulation`` at evenly spaced simulated instants
(``Simulation.run(observe=...)``: it reads between events and changes nothing, so the
run's results are the same with or without it) and keeps a dashboard frame for each.
``record_timeline`` runs one configuration that way and returns its results and the
HTML: the frames, the whole-run charts with a cursor, and a time slider.
"""

from __future__ import annotations

from typing import Any

from mori.core.decision_log import DecisionLog
from mori.core.explain import context_reader
from mori.dashboard.history import History
from mori.dashboard.page import timeline_page
from mori.dashboard.payload import charts, frame
from mori.dashboard.snapshot import take_snapshot
from mori.sim.config import SimConfig
from mori.sim.metrics import RunResult
from mori.sim.runner import Simulation
from mori.traces.model import TraceSet

DECISIONS_PER_FRAME = 40


class TimelineRecorder:
    """Frames of one simulated run, ``frames`` of them evenly over its duration."""

    def __init__(self, duration_s: float, frames: int = 300) -> None:
        if frames < 2:
            raise ValueError(f"a timeline needs at least 2 frames, got {frames}")
        self.duration_s = duration_s
        self.every_s = duration_s / frames
        self.log = DecisionLog(5000)
        # TTFT and throughput over a trailing window of a few frames (at least 30 s)
        self.history = History(window_s=max(30.0, 3 * self.every_s), keep_s=None)
        self.frames: list[dict[str, Any]] = []
        self._ttfts_seen = 0
        self._last_t = float("-inf")

    def attach(self, sim: Simulation) -> None:
        """Read the run's decisions with the programs' state (call before ``run``)."""
        self.log.read_context(context_reader(sim.policy.programs,
                                             sim.policy.return_cost))

    def __call__(self, sim: Simulation) -> None:
        now = sim.loop.now
        recent = [r for r in self.log.latest(DECISIONS_PER_FRAME) if r.time > self._last_t]
        snap = take_snapshot(sim.policy, now, recent)
        ttfts = sim.c.ttft[self._ttfts_seen:]
        self._ttfts_seen = len(sim.c.ttft)
        sample = self.history.record(now, snap.tiers, len(snap.held), sim.c.output_tokens,
                                     ttfts)
        self.frames.append(frame(snap, sample))
        self._last_t = now

    def html(self, run: str) -> str:
        return timeline_page(self.frames, charts(self.history, (0.0, self.duration_s),
                                                 x_label="simulated s", cursor=True),
                             self.duration_s, run)


def run_label(c: SimConfig) -> str:
    return (f"{c.policy} · {c.programs} programs · {c.replicas} replica(s) · {c.hardware} · "
            f"CPU ×{c.cpu_ratio:g} · {c.duration_s:g} s")


def record_timeline(config: SimConfig, traces: TraceSet, frames: int = 300
                    ) -> tuple[RunResult, str]:
    """Run ``config`` with a recorder: its results and the timeline's HTML."""
    rec = TimelineRecorder(config.duration_s, frames)
    sim = Simulation(config, traces, log=rec.log)
    rec.attach(sim)
    result = sim.run(observe=rec, every_s=rec.every_s)
    return result, rec.html(run_label(config))
