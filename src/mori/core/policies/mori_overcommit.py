"""A GPU tier sized to what the engine keeps up with (ours, not the paper's):
``Overcommit``, a part of ``MoriPolicy`` (its ``overcommit`` field, on where
``PolicyConfig.gpu_overcommit_max`` is above ``gpu_overcommit``).

MORI fills each replica's GPU tier up to the engine's KV pool and holds a request whose
program does not fit beside the Acting programs whose leaving does not pay yet. On an
engine that evicts by MORI's labels, an Acting program's KV is cached, not reserved: the
engine evicts it, the most idle first, when a running request needs the room. Holding a
request then pays only while the engine could not run it anyway. Where the engine keeps
up (a fast engine that stands idle while the gateway holds), a tier larger than the pool
admits more and holds fewer, and the engine's own eviction does the rest; where it does
not (the requests in flight need more KV than the pool holds: the engine queues them and
evicts what the next steps need), the pool-sized tier is what wins. Measured on the real
engine: docs/benchmarks.md, "The GPU tier overcommitted".

So the tier follows the engine, one size for all replicas, between ``gpu_overcommit``
and ``gpu_overcommit_max`` times the pool, changed at most once per ``period_s``
(``PolicyConfig.gpu_overcommit_period_s``; the load window by default; a gateway makes
it at least four of its readings of the engines, so that the queue a larger tier causes
is read before the next step):

- it **grows** by half while requests are held, the engines were idle at least a fifth
  of the time lately (their busy share below ``BUSY``: an engine busy all the time gains
  nothing from more requests; the engine's own running count where the gateway reads
  it, ``ReplicaLoad.engine_busy_share``, since a gateway's count of the requests it
  forwarded also covers their time outside the engine) and no replica is pressed (below
  the low mark, below);
- it **halves** when some replica is pressed beyond the high mark; the Acting programs
  beyond the smaller tier leave as when a program grows past it
  (``RoomMaker.fix_overflow``), and never below what the replica's running steps take.

*Pressed*, where the engine's counts are read (the gateway): the share of time its queue
was not empty lately (as ``ReplicaLoad.queue_share``), marks ``QUEUED_LOW`` and
``QUEUED_HIGH``: an engine whose queue never empties runs behind, evicting what the
next steps need (measured on the real engine: its queue was non-empty 50-61% of the time
where the larger tier won, 100% where it lost). Where they are not (the simulator): the
share of time the KV of the replica's Reasoning programs (``MoriBook.sums``), in the
policy's own sizes, was above the pool, marks ``OVERRUN_LOW`` and ``OVERRUN_HIGH``,
sampled at each decision round (not at every event). Both averaged with ``period_s``
as the time constant.

An approximation, stated: an engine also keeps room
for the tokens it is about to write, and the policy's sizes are its own estimates.
"""

from __future__ import annotations

from collections.abc import Callable

from mori.core.ledger import Placement
from mori.core.load import DecayedShare, ReplicaLoad
from mori.core.policies.mori_book import MoriBook
from mori.core.types import Tier

__all__ = ["Overcommit"]

GROW = 1.5
"""The factor the tier grows by at a step."""
SHRINK = 0.5
"""The factor it shrinks by."""
BUSY = 0.8
"""The mean busy share below which held requests may grow the tier."""
OVERRUN_LOW = 0.1
"""The share of time in-flight KV may have overrun the pool for the tier to grow."""
OVERRUN_HIGH = 0.5
"""The share beyond which it shrinks."""
QUEUED_LOW = 0.6
"""The share of time an engine's queue may have been non-empty for the tier to grow."""
QUEUED_HIGH = 0.8
"""The share beyond which it shrinks."""


class Overcommit:
    """The adaptive size of a policy's GPU tiers (the module docstring).
    ``pool_bytes``: each replica's engine pool; ``held()``: whether any request is held;
    ``changed(r)``: replica ``r``'s GPU capacity changed (the book resyncs it)."""

    def __init__(self, placement: Placement, book: MoriBook, load: ReplicaLoad,
                 pool_bytes: int, low: float, high: float, period_s: float,
                 held: Callable[[], bool]) -> None:
        if not 1.0 <= low <= high:
            raise ValueError(f"overcommit bounds must be 1 <= low <= high, got {low}, {high}")
        self.placement = placement
        self.book = book
        self.load = load
        self.pool = pool_bytes
        self.low = low
        self.high = high
        self.x = low
        """The tier now, as a multiple of the pool."""
        self.period_s = period_s
        self.held = held
        self._overrun = [DecayedShare(period_s, 0.0) for _ in placement.gpu]
        self._queued = [DecayedShare(period_s, 0.0) for _ in placement.gpu]
        self._last: float | None = None
        self.changes = 0

    def observe(self, now: float) -> None:
        """Sample each replica's in-flight KV against its pool, and its engine's queue
        as last read (each decision round)."""
        reasoning = self.book.sums.reasoning
        for r, share in enumerate(self._overrun):
            over = reasoning[r] > self.pool
            if over != share.on:
                share.set(over, now)
            queued = self.load.queued_now(r)
            if queued != self._queued[r].on:
                self._queued[r].set(queued, now)

    def adjust(self, now: float) -> bool:
        """Grow or shrink the tier if the rule says so and a period has passed since the
        last look, and bring a tier still above its size down as far as the steps running
        allow (every round); whether the tier changed."""
        up = [r for r in range(len(self.placement.gpu)) if r not in self.placement.down]
        if not up:
            return False
        if self._last is None or now - self._last >= self.period_s:
            self._last = now
            press = [self._pressed(r, now) for r in up]
            if any(share > high for share, _, high in press) and self.x > self.low:
                self.x = max(self.low, self.x * SHRINK)
                self.changes += 1
            elif (self.x < self.high and all(share < low for share, low, _ in press)
                    and self.held()
                    and sum(self.load.engine_busy_share(r, now) for r in up) / len(up) < BUSY):
                self.x = min(self.high, self.x * GROW)
                self.changes += 1
        return self._settle(up)

    def _pressed(self, r: int, now: float) -> tuple[float, float, float]:
        """How pressed replica ``r`` is, with the marks to read it by: its engine's
        queue share where the engine is read, else its in-flight KV's overrun share."""
        if self.load.engine_read(r):
            return self._queued[r].at(now), QUEUED_LOW, QUEUED_HIGH
        return self._overrun[r].at(now), OVERRUN_LOW, OVERRUN_HIGH

    def _settle(self, up: list[int]) -> bool:
        """Every up replica's GPU tier becomes ``x`` pools, never below the KV of the
        steps running on any (those cannot leave: a smaller tier waits for them to end,
        and each that ends then leaves as the overflow rule says); a tier now over it
        is marked for the round's overflow rule. Whether it changed."""
        target = int(self.pool * self.x)
        cap = self.book.cap
        if cap == target:
            return False
        gpus, reasoning = self.placement.gpu, self.book.sums.reasoning
        if cap > target:
            new = max(target, *(reasoning[r] for r in up))
            if new >= cap:
                return False  # the running steps hold it where it is for now
        else:
            new = target
        self.book.cap = new
        for r in up:
            gpus[r].capacity = new
            if gpus[r].over():
                self.book.grown.add((Tier.GPU, r))
            self.book.capacity_changed(r)
        return True

    def capacity(self) -> int:
        """The GPU capacity of a replica now (one that comes back up gets it)."""
        return self.book.cap
