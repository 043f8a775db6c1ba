"""Windowed idleness (docs/system.md, "Idleness").

    idleness = T_acting(k) / (T_reasoning(k) + T_acting(k))

over the last ``k`` reasoning-acting cycles. The window is the cycle in progress (if one
has started: the program is reasoning or acting) plus the last completed cycles, ``k``
in all; while the program is held no cycle is in progress and the window is the last
``k`` completed cycles. The in-progress part counts: an ongoing tool call's elapsed time
keeps growing. Time spent held (queued by the scheduler, or waiting for its KV to
reload) is excluded from both terms unless ``exclude_held`` is False (the
``mori-no-exclusion`` ablation), in which case it is added to the acting term of the
cycle that preceded it (for a program's very first request there is no such cycle and it
is dropped). A program with no history has idleness = 0 (busy): it is about to run.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from mori.core.types import Status


@dataclass(frozen=True, slots=True)
class IdlenessHistory:
    """What a tracker knew at one moment, to carry a program's rank across a restart:
    its completed cycles in the window (oldest first, ``(reasoning, acting)`` seconds)
    and, for a program in a tool call, the cycle in progress: its reasoning time and how
    long the tool call had lasted. A step cut off mid-way (a request in flight) leaves
    only the completed cycles."""

    cycles: tuple[tuple[float, float], ...] = ()
    reasoning_s: float = 0.0
    acting_s: float = 0.0

    def __post_init__(self) -> None:
        values = [self.reasoning_s, self.acting_s, *(x for c in self.cycles for x in c)]
        if any(len(c) != 2 for c in self.cycles) or not all(
                math.isfinite(v) and v >= 0.0 for v in values):
            raise ValueError(f"an idleness history holds pairs of finite seconds >= 0: "
                             f"{self!r}")

    def later(self, seconds: float) -> IdlenessHistory:
        """The same, ``seconds`` later: a tool call in progress went on meanwhile."""
        if self.acting_s <= 0.0 and self.reasoning_s <= 0.0:
            return self
        return IdlenessHistory(self.cycles, self.reasoning_s,
                               self.acting_s + max(0.0, seconds))


class IdlenessTracker:
    """Feeds on three timestamps per step and answers ``idleness(now)``.

    Observations must come in order: ``arrived`` -> ``started`` -> ``finished`` ->
    ``arrived`` ... with non-decreasing times. ``started`` marks the start of reasoning
    (the request was forwarded and its KV is ready); calling it again while reasoning
    moves the start later (the extra interval becomes held time).

    The tracker is the program's only phase machine: ``status`` (None before the first
    request) is what ``Program.status`` reads.
    """

    __slots__ = (
        "_k", "_exclude_held", "_cycles", "_phase", "_t0", "_cur_reason", "_held_total",
        "_all", "_tail",
    )

    def __init__(self, k: int = 5, exclude_held: bool = True) -> None:
        if k < 1:
            raise ValueError(f"idleness window k must be >= 1, got {k}")
        self._k = k
        self._exclude_held = exclude_held
        self._cycles: deque[tuple[float, float]] = deque()
        self._phase: Status | None = None
        self._t0 = 0.0  # start of the current phase
        self._cur_reason = 0.0  # reasoning time of the cycle in progress (once acting)
        self._held_total = 0.0
        self._all = (0.0, 0.0)  # sums (reasoning, acting) over the completed cycles kept
        self._tail = (0.0, 0.0)  # the same without the oldest when k are kept

    # -- observations -------------------------------------------------------------
    def _check_time(self, now: float) -> None:
        if now < self._t0:
            raise ValueError(f"time went backwards: {now} < {self._t0}")

    def arrived(self, now: float) -> None:
        """A request arrived: the tool call (if any) ended, the program is held."""
        self._check_time(now)
        if self._phase is Status.ACTING:
            self._push(self._cur_reason, max(0.0, now - self._t0))
        elif self._phase is not None:
            raise ValueError(f"arrived while {self._phase.value}")
        self._phase = Status.HELD
        self._t0 = now

    def started(self, now: float) -> None:
        """Reasoning starts now (forwarded, KV ready)."""
        self._check_time(now)
        if self._phase is Status.HELD:
            self._end_held(now)
        elif self._phase is Status.REASONING:
            # the KV became ready later than the forward: that interval was held
            extra = max(0.0, now - self._t0)
            self._held_total += extra
            if not self._exclude_held and self._cycles:
                self._add_held_to_last(extra)
        else:
            raise ValueError(f"started while {self._state()}")
        self._phase = Status.REASONING
        self._t0 = now

    def finished(self, now: float) -> None:
        """The response ended: the program is acting (in a tool call)."""
        self._check_time(now)
        if self._phase is not Status.REASONING:
            raise ValueError(f"finished while {self._state()}")
        self._cur_reason = max(0.0, now - self._t0)
        self._phase = Status.ACTING
        self._t0 = now

    def restored(self, now: float = 0.0, history: IdlenessHistory | None = None) -> None:
        """A program taken in between two steps (``ProgramRestored``): Acting since
        ``now``, with no cycle recorded (its idleness is 1 as soon as time passes, until
        its next step), or, given its ``history``, where that history left it: its
        completed cycles, and a tool call that began ``history.acting_s`` before ``now``
        after ``history.reasoning_s`` of reasoning."""
        if self._phase is not None:
            raise ValueError(f"restored while {self._phase.value}")
        self._phase = Status.ACTING
        self._cur_reason = 0.0
        self._t0 = now
        if history is None:
            return
        for reason, act in history.cycles[-self._k:]:
            self._cycles.append((reason, act))
        self._resum()
        self._cur_reason = history.reasoning_s
        self._t0 = now - history.acting_s

    def history(self, now: float) -> IdlenessHistory:
        """What this tracker knows at ``now`` (``restored`` takes it back)."""
        if self._phase is Status.ACTING:
            return IdlenessHistory(tuple(self._cycles), self._cur_reason,
                                   max(0.0, now - self._t0))
        return IdlenessHistory(tuple(self._cycles))

    def _state(self) -> str:
        return "new" if self._phase is None else self._phase.value

    # -- queries --------------------------------------------------------------------
    @property
    def status(self) -> Status | None:
        """The phase: HELD, REASONING or ACTING; None before the first request."""
        return self._phase

    def idleness(self, now: float) -> float:
        phase = self._phase
        if phase is Status.REASONING or phase is Status.ACTING:
            r, a = self._tail  # the cycle in progress is one of the k
        else:
            r, a = self._all
        if phase is Status.REASONING:
            r += max(0.0, now - self._t0)
        elif phase is Status.ACTING:
            r += self._cur_reason
            a += max(0.0, now - self._t0)
        elif phase is Status.HELD and not self._exclude_held and self._cycles:
            a += max(0.0, now - self._t0)
        total = r + a
        return a / total if total > 0.0 else 0.0

    def acting_line(self) -> tuple[float, float] | None:
        """While acting: ``(w, b)`` with ``idleness(now) = 1 - w / (now - b)`` (up to
        rounding): ``w`` the reasoning time in the window, ``b`` when the window would
        have begun had it been spent without a break. Both are fixed until the next
        request, so an ordering structure can bound idleness at any ``now`` without
        computing it. None in other phases."""
        if self._phase is not Status.ACTING:
            return None
        r, a = self._tail
        w = r + self._cur_reason
        return w, self._t0 - w - a

    @property
    def held_time(self) -> float:
        """Total seconds spent held so far (completed held intervals)."""
        return self._held_total

    @property
    def cycles(self) -> tuple[tuple[float, float], ...]:
        """The completed cycles in the window, oldest first, as (reasoning, acting)."""
        return tuple(self._cycles)

    # -- internals -----------------------------------------------------------------
    def _push(self, reason: float, act: float) -> None:
        # keep k completed cycles; idleness() uses k - 1 of them while a cycle is in progress
        self._cycles.append((reason, act))
        if len(self._cycles) > self._k:
            self._cycles.popleft()
        self._resum()

    def _resum(self) -> None:
        """Cache the window sums (k is small; summing afresh avoids float drift)."""
        r_all = a_all = r_tail = a_tail = 0.0  # added in order, as sum() adds floats
        skip = len(self._cycles) == self._k  # the tail leaves out the oldest
        for r, a in self._cycles:
            r_all += r
            a_all += a
            if skip:
                skip = False
            else:
                r_tail += r
                a_tail += a
        self._all = (r_all, a_all)
        self._tail = (r_tail, a_tail)

    def _end_held(self, now: float) -> None:
        held = max(0.0, now - self._t0)
        self._held_total += held
        if not self._exclude_held and self._cycles:
            self._add_held_to_last(held)

    def _add_held_to_last(self, held: float) -> None:
        r, a = self._cycles[-1]
        self._cycles[-1] = (r, a + held)
        self._resum()
