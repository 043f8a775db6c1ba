"""The dashboard's time series: tier occupancy, throughput, TTFT and the gated queue.

A world records a sample now and then (the gateway once a second, a simulated run at
evenly spaced instants): its tiers, the held requests, its output-token count so far and
the TTFTs observed since the previous sample. ``History`` turns those into points:
tokens per second and TTFT percentiles over a trailing ``window_s``. Pure: time is passed
in.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mori.dashboard.snapshot import TierRow

NAN = float("nan")


@dataclass(frozen=True, slots=True)
class Sample:
    """One point. ``gpu`` and ``cpu``: each replica's used share of its tier (0..1);
    ``ttft``: (p50, p90, p99) seconds over the window, NaN where no request started."""

    t: float
    gpu: tuple[float, ...]
    cpu: tuple[float, ...]
    gated: int
    tokens_per_s: float
    ttft: tuple[float, float, float]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> tuple[float, ...]:
    """Linear-interpolated percentiles (q in 0..100); NaN for each when ``values`` is
    empty."""
    if not values:
        return tuple(NAN for _ in qs)
    xs = sorted(values)
    out = []
    for q in qs:
        k = (len(xs) - 1) * q / 100.0
        lo = math.floor(k)
        hi = min(lo + 1, len(xs) - 1)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))
    return tuple(out)


class History:
    """Samples over the last ``keep_s`` seconds (None: all of them).

    ``window_s``: the trailing window of the throughput and TTFT figures.
    """

    def __init__(self, window_s: float = 30.0, keep_s: float | None = 300.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if keep_s is not None and keep_s <= 0:
            raise ValueError(f"keep_s must be > 0 or None, got {keep_s}")
        self.window_s = window_s
        self.keep_s = keep_s
        self.samples: deque[Sample] = deque()
        self._tokens: deque[tuple[float, int]] = deque()  # (t, output tokens so far)
        self._ttft: deque[tuple[float, float]] = deque()  # (t observed, seconds)

    def record(self, t: float, tiers: Sequence[TierRow], gated: int, tokens_total: int,
               ttfts: Iterable[float]) -> Sample:
        """Add the sample at ``t`` (not before the previous one)."""
        if self.samples and t < self.samples[-1].t:
            raise ValueError(f"samples go forward in time: {t} < {self.samples[-1].t}")
        start = t - self.window_s
        toks = self._tokens
        toks.append((t, tokens_total))
        while len(toks) > 2 and toks[1][0] <= start:
            toks.popleft()  # keep one point at or before the window's start
        t0, n0 = toks[0]
        rate = (tokens_total - n0) / (t - t0) if t > t0 else 0.0
        tt = self._ttft
        tt.extend((t, v) for v in ttfts)
        while tt and tt[0][0] <= start:
            tt.popleft()
        p50, p90, p99 = percentiles([v for _, v in tt], (50, 90, 99))
        s = Sample(t, tuple(r.gpu_frac for r in tiers), tuple(r.cpu_frac for r in tiers),
                   gated, rate, (p50, p90, p99))
        self.samples.append(s)
        if self.keep_s is not None:
            while self.samples and self.samples[0].t < t - self.keep_s:
                self.samples.popleft()
        return s

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None
