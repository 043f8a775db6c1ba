"""Who may leave the GPU to make room for a ready program: MORI's rule, and the variants'.

MORI's rule: a ready program outranks every Acting one (it is about to reason, the other
sits idle in a tool call), so any Acting program may make room, and the ranking decides
*which*: the most idle first (``mori_room``). The variants hand the policy their own
rule (``MoriPolicy``'s ``ranking``) instead of overriding its methods:

- ``mori-strict``: only programs more idle than the ready one (``MoreIdle``);
- ``mori-binary``: only programs idle by a fixed threshold, and no ranking of the CPU
  tier (``Threshold``);
- ``mori-ski``: an Acting program only once it has acted as long as its reload would
  take (``SkiRental``).

``any_victim`` says whether any Acting program may leave for any ready one
(``victim_ok`` is MORI's), ``any_time`` whether it may leave at any time
(``displaceable`` is MORI's); ``own``, both. The round's fast paths assume them: the
room plan from sums (``RoomMaker.plan_fast``) both, the blocked-round check
(``IndexedRound.blocked``, which needs no Acting program to be displaced) ``any_victim``
only.
"""

from __future__ import annotations

from collections.abc import Callable

from mori.core.program import Program


class Ranking:
    """MORI's rule: every Acting program may make room, at any time."""

    any_victim = True
    any_time = True
    ranks_cpu = True
    """Whether a demoted program may push more idle ones out of a full CPU tier (the
    CPU tier holds the next-best ranked); False: it goes to no tier itself."""

    @property
    def own(self) -> bool:
        """MORI's own rule in full."""
        return self.any_victim and self.any_time

    def victim_ok(self, victim_idleness: float, cand_idleness: float) -> bool:
        """May a program with ``victim_idleness`` make room for one with
        ``cand_idleness``? (Requiring ``victim_idleness > cand_idleness`` instead leaves
        the GPU idle while a ready program waits for a busy one's phase to change; we
        measured it: -20% throughput at 20 programs, see docs/results.md.)"""
        return True

    def displaceable(self, p: Program, now: float) -> bool:
        """May the Acting program ``p`` be demoted now to make room for a ready one?"""
        return True


class MoreIdle(Ranking):
    """``mori-strict``: only a program more idle than the ready one makes room."""

    any_victim = False

    def victim_ok(self, victim_idleness: float, cand_idleness: float) -> bool:
        return victim_idleness > cand_idleness


class Threshold(Ranking):
    """``mori-binary``: only a program idle by the threshold (idleness >= it); no
    ranking decides who deserves the CPU tier, so a program demoted to a full one goes
    to no tier."""

    any_victim = False
    ranks_cpu = False

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def idle(self, idleness: float) -> bool:
        return idleness >= self.threshold

    def victim_ok(self, victim_idleness: float, cand_idleness: float) -> bool:
        return self.idle(victim_idleness)


class SkiRental(Ranking):
    """``mori-ski``: an Acting program once it has acted at least as long as its reload
    would take (``reload_s``: the policy's estimate, ``Policy.reload_s``)."""

    any_time = False

    def __init__(self, reload_s: Callable[[Program], float]) -> None:
        self.reload_s = reload_s

    def displaceable(self, p: Program, now: float) -> bool:
        last = p.history[-1] if p.history else None
        if last is None or last.finished is None:
            return True
        return now - last.finished >= self.reload_s(p)
