"""The dashboard's time series: tier occupancy, throughput, TTFT and the held requests.

A world records a sample now and then (the gateway once a second, a simulated run at
evenly spaced instants): its tiers, the held requests, its output-token count so far and
the TTFTs observed since the previous sample. ``History`` turns those into points:
tokens per second and TTFT percentiles over a trailing ``window_s``. Pure: time is passed
in.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mori.dashboard.snapshot import TierRow

NAN = float("nan")
TTFTS_PER_SAMPLE = 128
"""The most TTFTs a sample keeps. Beyond, it keeps that many order statistics of them
(the middle one of each of as many equal runs of the sorted values), each standing for
its run, so the window's percentiles are then approximate. This bounds a sample's work
on a busy gateway: at 2,000 requests a second the 30 s window held 60,000 values, all
sorted once a second (tens of milliseconds in which the gateway served nobody)."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One point. ``gpu`` and ``cpu``: each replica's used share of its tier (0..1);
    ``ttft``: (p50, p90, p99) seconds over the window, NaN where no request started."""

    t: float
    gpu: tuple[float, ...]
    cpu: tuple[float, ...]
    held: int
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


def weighted_percentiles(pairs: Sequence[tuple[float, int]], qs: Sequence[float]
                         ) -> tuple[float, ...]:
    """``percentiles`` of the values ``pairs`` stand for: (value, how many times)."""
    if not pairs:
        return tuple(NAN for _ in qs)
    ordered = sorted(pairs)
    xs = [v for v, _ in ordered]
    ends = list(itertools.accumulate(n for _, n in ordered))  # positions < ends[j]: xs[j]
    last = ends[-1] - 1

    def at(pos: int) -> float:
        return xs[bisect.bisect_right(ends, pos)]

    out = []
    for q in qs:
        k = last * q / 100.0
        lo = math.floor(k)
        a, b = at(lo), at(min(lo + 1, last))
        out.append(a + (b - a) * (k - lo))
    return tuple(out)


def _reduced(values: Iterable[float], keep: int) -> list[tuple[float, int]]:
    """``values`` as (value, count) pairs, at most ``keep`` of them (module doc)."""
    xs = sorted(values)
    if len(xs) <= keep:
        return [(v, 1) for v in xs]
    size, extra = divmod(len(xs), keep)
    out, start = [], 0
    for i in range(keep):
        n = size + (i < extra)
        out.append((xs[start + n // 2], n))
        start += n
    return out


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
        self._ttft: deque[tuple[float, list[tuple[float, int]]]] = deque()  # (t, reduced)

    def record(self, t: float, tiers: Sequence[TierRow], held: int, tokens_total: int,
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
        tt.append((t, _reduced(ttfts, TTFTS_PER_SAMPLE)))
        while tt and tt[0][0] <= start:
            tt.popleft()
        p50, p90, p99 = weighted_percentiles([p for _, ps in tt for p in ps], (50, 90, 99))
        s = Sample(t, tuple(r.gpu_frac for r in tiers), tuple(r.cpu_frac for r in tiers),
                   held, rate, (p50, p90, p99))
        self.samples.append(s)
        if self.keep_s is not None:
            while self.samples and self.samples[0].t < t - self.keep_s:
                self.samples.popleft()
        return s

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None
