"""One decision of MORI: the ``Round`` every phase is handed, created per decision.

``MoriPolicy._decide`` (``mori``) creates a ``Round`` and runs the phases in this order,
each handed the round explicitly:

1. **rebalance**: a variant's moves on every round (``mori_rebalancers``; MORI has none);
2. **overflow**: each queue a program grew past its capacity is brought back to it, the
   disk queues (``mori_disk``), then the GPU and CPU queues (``RoomMaker.fix_overflow``,
   ``mori_room``);
3. **aged**: requests held past the bound on waiting go first (``mori_aged``); one that
   must wait for running steps to end reserves its replica's free space for the round
   (``Round.held_for``);
4. **forward**: the held requests of GPU-resident programs go to their replicas;
5. **promote**: the other held requests by priority (``mori_index.priority``), from the
   kept-up-to-date index (``mori_promote``) or by scanning every held request
   (``mori_promote_scan``, the reference and the path of ``mori-no-exclusion``);
6. **each replica**: every replica where no room was made or reserved makes room for
   its own first parked candidate, if it can now (``RoomMaker.each_replica``);
7. **idle fill**: an idle replica takes a held request (``mori_idle_fill``; off by default).

What lives for one round only lives here: the time, the idleness of each program as
computed this round (``IdlenessAt``), the decisions taken, the GPU space reserved for a
candidate until running steps end (``reserve``), and whether the promotions are walking
the candidate index (``walking``). Nothing of it outlives ``_decide``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mori.core.decisions import Decision
from mori.core.program import Program

__all__ = ["IdlenessAt", "Round"]


class IdlenessAt:
    """Idleness of each program, computed once per decision round."""

    __slots__ = ("now", "_memo")

    def __init__(self, now: float) -> None:
        self.now = now
        self._memo: dict[str, float] = {}

    def __call__(self, p: Program) -> float:
        v = self._memo.get(p.program_id)
        if v is None:
            v = p.tracker.idleness(self.now)
            self._memo[p.program_id] = v
        return v

    def hold(self, p: Program, value: float) -> None:
        """Take ``value`` as ``p``'s idleness this round unless one was computed already."""
        self._memo.setdefault(p.program_id, value)

    def desc(self, p: Program) -> tuple[float, int]:
        """Sort key: highest idleness first, then the most recent request last in."""
        return (-self(p), -p.ready_seq)


@dataclass(slots=True)
class Round:
    """One decision round (the module docstring): created by ``MoriPolicy._decide``,
    handed to every phase, dropped at its end."""

    now: float
    out: list[Decision]
    """The decisions taken, in order."""
    idleness: IdlenessAt
    reserve: dict[int, int] = field(default_factory=dict)
    """Per replica, GPU bytes held free for a candidate until running steps end (room
    made by demoting Reasoning programs lazily, or a request past the bound waiting):
    later candidates may only use space beyond it."""
    held_for: int | None = None
    """The replica a request past the bound waits for (``WaitBound.serve``): its free
    space is reserved from the start of the promotions."""
    walking: bool = False
    """Whether the indexed promotions are walking the candidate index (``mori_promote``):
    the book is not re-indexed meanwhile, and the fast paths that read it apply."""

    @classmethod
    def at(cls, now: float, out: list[Decision]) -> Round:
        return cls(now, out, IdlenessAt(now))

    def into(self, out: list[Decision]) -> Round:
        """This round with its decisions collected in ``out`` instead (the indexed
        promotions collect them per candidate, then emit them in priority order): the
        reservations, the idleness and the walk are shared."""
        return Round(self.now, out, self.idleness, self.reserve, self.held_for, self.walking)

    def reserved(self, replica: int) -> int:
        """GPU bytes held free on ``replica`` this round."""
        return self.reserve.get(replica, 0)
