"""One clock, one heap keyed (time, priority, sequence): deterministic event order."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    """A minimal discrete-event loop (after SimPy's core).

    Events at the same time run by ``priority`` (lower first), then in the order they
    were scheduled. Handlers may schedule further events. Cancellation is the caller's
    business (handlers check a version number they captured).
    """

    __slots__ = ("now", "_heap", "_seq", "events_run")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, t: float, priority: int, fn: Callable[..., None], *args: Any) -> None:
        if t < self.now:
            raise ValueError(f"cannot schedule in the past: {t} < {self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (t, priority, self._seq, fn, args))

    def next_time(self) -> float | None:
        """The time of the next event, None when none is scheduled."""
        return self._heap[0][0] if self._heap else None

    def run(self, until: float) -> None:
        """Run events with time <= ``until``; the clock ends at ``until``."""
        heap, pop, n = self._heap, heapq.heappop, 0
        try:
            while heap and heap[0][0] <= until:
                t, _, _, fn, args = pop(heap)
                self.now = t
                n += 1
                fn(*args)
        finally:
            self.events_run += n
        self.now = until


# Priorities: engine progress before arrivals at the same instant, ticks last.
PRIO_ENGINE = 0
PRIO_WORKLOAD = 1
PRIO_TICK = 2
