"""The JSON the dashboard page renders: one frame per instant, and the charts.

A frame holds a snapshot's tables as compact rows (lists, not objects: a timeline holds
hundreds of frames) and the idleness spectrum as SVG. The charts are drawn from a
``History``: over the last minutes in the live view, over the whole run (with a cursor)
in a timeline.
"""

from __future__ import annotations

import math
from typing import Any

from mori.core.types import Status, Tier
from mori.dashboard.history import History, Sample
from mori.dashboard.snapshot import Snapshot
from mori.dashboard.svg import PALETTE, Series, line_chart, spectrum


def _num(v: float, digits: int) -> float | None:
    """JSON has no NaN: None for it."""
    return round(v, digits) if math.isfinite(v) else None


def frame(snap: Snapshot, sample: Sample | None) -> dict[str, Any]:
    """One instant: summary figures, the tables and the spectrum."""
    summary: dict[str, Any] = {
        "programs": len(snap.programs),
        **{s.value: snap.count(status=s) for s in Status},
        **{f"tier_{t.value}": snap.count(tier=t) for t in Tier},
        "tokens_per_s": _num(sample.tokens_per_s, 1) if sample else None,
        "ttft_p50_s": _num(sample.ttft[0], 3) if sample else None,
        "ttft_p99_s": _num(sample.ttft[2], 3) if sample else None,
    }
    return {
        "t": round(snap.time, 3),
        "summary": summary,
        "programs": [[p.program_id, round(p.idleness, 4), p.status.value, p.tier.value, p.replica,
                      p.context_tokens,
                      None if p.since_request_s is None else round(p.since_request_s, 1),
                      p.steps, p.agent, p.tools] for p in snap.programs],
        "tiers": [[r.replica, r.gpu_tokens, r.gpu_capacity, r.cpu_tokens, r.cpu_capacity,
                   r.gpu_programs, r.cpu_programs] for r in snap.tiers],
        "held": [[g.program_id, round(g.waited_s, 2), g.tier.value, g.replica,
                   g.context_tokens] for g in snap.held],
        "decisions": [[round(d.time, 3), d.kind, d.program_id, d.replica, d.move, d.reason]
                      for d in snap.decisions],
        "spectrum": spectrum([(p.idleness, p.status, p.tier) for p in snap.programs]),
    }


def charts(history: History, x_range: tuple[float, float], origin: float = 0.0,
           x_label: str = "s", cursor: bool = False) -> dict[str, str]:
    """The time-series charts over ``x_range`` (seconds after ``origin``)."""
    samples = list(history.samples)
    xs = [s.t - origin for s in samples]
    replicas = len(samples[-1].gpu) if samples else 0

    def per_replica(attr: str) -> list[Series]:
        return [Series(f"r{r}", [100.0 * getattr(s, attr)[r] for s in samples],
                       PALETTE[r % len(PALETTE)]) for r in range(replicas)]

    common: dict[str, Any] = {"x_range": x_range, "x_label": x_label, "cursor": cursor}
    return {
        "gpu": line_chart("GPU tier used", xs, per_replica("gpu"), y_max=100.0, unit="%",
                          chart_id="chart-gpu", **common),
        "cpu": line_chart("CPU tier used", xs, per_replica("cpu"), y_max=100.0, unit="%",
                          chart_id="chart-cpu", **common),
        "throughput": line_chart("Output tokens/s", xs, [
            Series("tok/s", [s.tokens_per_s for s in samples], PALETTE[0])],
            chart_id="chart-throughput", **common),
        "ttft": line_chart("TTFT", xs, [
            Series(name, [s.ttft[i] for s in samples], colour)
            for i, (name, colour) in enumerate((("p50", PALETTE[2]), ("p90", PALETTE[1]),
                                                ("p99", PALETTE[3])))],
            unit="s", chart_id="chart-ttft", **common),
        "held": line_chart("Held requests", xs, [
            Series("held", [float(s.held) for s in samples], PALETTE[3])],
            chart_id="chart-held", **common),
    }
