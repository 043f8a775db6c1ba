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
(``IndexedPromotion.blocked``, which needs no Acting program to be displaced) ``any_victim``
only.

Measured (the rules against each other, ``ReturnCost``'s parts): docs/results.md, "MORI
that never loses"; docs/benchmarks.md, "The engine as the bottleneck".
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mori.core.ledger import Placement
from mori.core.load import ReplicaLoad
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_disk import DiskTier
from mori.core.policies.mori_round import IdlenessAt
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
        ``cand_idleness``? (Requiring ``victim_idleness > cand_idleness`` instead,
        ``mori-strict``, leaves the GPU idle while a ready program waits for a busy one's
        phase to change; measured among the ablations in docs/results.md.)"""
        return True

    def displaceable(self, p: Program, idleness: IdlenessAt) -> bool:
        """May the Acting program ``p`` be demoted now (``idleness.now``) to make room
        for a ready one?"""
        return True

    def cpu_droppable(self, q: Program, idleness: IdlenessAt) -> bool:
        """May ``q`` be pushed out of a full CPU tier, to no tier, to park a less idle
        program there?"""
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

    def displaceable(self, p: Program, idleness: IdlenessAt) -> bool:
        last = p.history[-1] if p.history else None
        if last is None or last.finished is None:
            return True
        return idleness.now - last.finished >= self.reload_s(p)


class ReturnCost(Ranking):
    """MORI's default rule (ours, not the paper's): a move off a tier must pay for what
    the program's return will cost the replica.

    - Parked: a program demoted into room in its replica's CPU tier returns by a reload.
      The link copies while the GPU computes, so the transfer costs the replica no GPU
      time: by the paper's rule it may leave at once. Where the gateway measured the
      replica's engine spending its own time on reloads (``reload_engine_s``, learned
      from its answers, ``mori.core.engine_costs``: vLLM's host tier on a CPU), that
      time is priced as a recompute's is, for every program it delays (``park_s``), and
      the program may leave once it has been away that long (``park_pays``): the
      ski-rental rule on the reload's price. Measured (docs/benchmarks.md, the
      bottleneck benchmark on the dev100 traces): parking at once there made nearly
      every request a reload.
    - Dropped: a program with no room to park returns by a recompute of its whole
      context (``recompute_s``), which takes the GPU from every program on the replica.
      It may be dropped only once it has been away (in its tool call) at least that
      long for each of them: ``recompute_s`` times the programs on the replica's GPU
      (``drop_s``). The ski-rental rule on the drop's price: a program that returns
      sooner never paid for its return; one that stays away longer has held its room
      idle for as long as its return costs, so dropping it costs at most twice what
      knowing the future would have.
    - Only while the engine has work: a recompute delays the others only while they
      have steps to run, so the programs on the GPU count as far as the replica has been
      busy lately (``delayed``: times its busy share, ``mori.core.load``, never below
      one; ``load``, None: always busy). Measured (docs/benchmarks.md, the bottleneck
      benchmark): on an engine idle most of the time the old count held requests the
      engine had room for.
    - Only while the engine could run more: a program's room stands idle for the request
      it keeps out only while the engine has no queue of its own; while requests wait
      inside the engine, the newcomer would wait there instead, and the move would only
      add its return's cost. So both prices count over the replica's unqueued share
      (``unqueued``: the engine's waiting count, as the gateway reads it; 1 where no
      engine is read, as in the simulator): a move pays once the program has been away
      its price over that share (measured: docs/benchmarks.md, "Moves that wait while
      the engine queues").
    - Room to park made by dropping: where the CPU tier is at least as large as the GPU
      tier, a program may park by pushing out of the CPU tier programs more idle than it
      whose drop pays (``cpu_droppable``). Where it is smaller, only free room parks; a
      program parks in a full one only once its own drop would pay, and then pushes out
      the most idle as the paper does. Why the size of the tier decides: measured on the
      ``never-loses`` grid, docs/results.md ("MORI that never loses").

    - Kept on disk (a replica with a disk tier, ``mori_disk``): a program that would be
      dropped goes to its replica's disk where that pays; its return reads it back, which
      costs the replica no GPU time but delays the program's own step by the read. It
      may leave once it has been away at least as long as that read
      (``disk_reload_s``): the ski-rental rule on the read's price.

    With no CPU tier, or a full one, the admitted working set stays put while newcomers
    wait, as ThunderAgent keeps it.
    """

    any_time = False

    def __init__(self, placement: Placement, book: MoriBook,
                 reload_s: Callable[[Program], float],
                 recompute_s: Callable[[Program], float],
                 disk: DiskTier | None = None, load: ReplicaLoad | None = None,
                 reload_engine_s: Callable[[Program], float] | None = None) -> None:
        self.placement = placement
        self.reload_engine_s = reload_engine_s
        self.book = book
        self.reload_s = reload_s
        self.recompute_s = recompute_s
        self.disk = disk
        self.load = load

    def delayed(self, replica: int | None, now: float) -> float:
        """How many programs a recompute on ``replica`` is priced as delaying: those on
        its GPU, scaled by its recent busy share where the policy follows load (a
        recompute on an engine that would otherwise idle delays no one but the program
        itself), never fewer than one."""
        if replica is None:
            return 1.0
        n = float(len(self.placement.gpu[replica].members))
        if self.load is not None:
            n *= self.load.share(replica, now)
        return max(1.0, n)

    def drop_s(self, p: Program, now: float) -> float:
        """What dropping ``p`` costs its replica, in seconds: its recompute, for each
        program the recompute delays (``delayed``), over the replica's unqueued share
        (``unqueued``)."""
        return _over(self.recompute_s(p) * self.delayed(p.replica, now),
                     self.unqueued(p.replica, now))

    def unqueued(self, replica: int | None, now: float) -> float:
        """The recent share of time ``replica``'s engine had no request waiting (1: no
        queue known). A program's room stands idle for the one it keeps out only while
        the engine could have run more: while the engine's own queue is full, the
        newcomer would wait there instead, so only that share of a program's time away
        counts toward its leaving."""
        if replica is None or self.load is None:
            return 1.0
        return 1.0 - self.load.queue_share(replica, now)

    @staticmethod
    def away_s(p: Program, now: float) -> float:
        """How long ``p`` has been in its tool call (inf: it never ran a step here)."""
        last = p.history[-1] if p.history else None
        if last is None or last.finished is None:
            return math.inf
        return now - last.finished

    def pays(self, p: Program, now: float) -> bool:
        """Whether dropping ``p`` now pays for its return (``drop_s``)."""
        return self.away_s(p, now) >= self.drop_s(p, now)

    def large_tier(self, replica: int) -> bool:
        """Whether ``replica``'s CPU tier is at least as large as its GPU tier."""
        gpu, cpu = self.placement.gpu[replica].capacity, self.placement.cpu[replica].capacity
        return gpu is None or cpu is None or cpu >= gpu

    def parks(self, p: Program, idleness: IdlenessAt) -> bool:
        """Whether ``p``, demoted now, keeps its KV in its replica's CPU tier: in free
        room, or (a large tier) in room made by drops that pay."""
        r = p.replica
        if r is None:
            return False
        cq = self.placement.cpu[r]
        if not cq.capacity or p.kv_bytes > cq.capacity or math.isinf(self.reload_s(p)):
            return False  # no tier, too large for it, or no link to reload over
        need = p.kv_bytes - cq.free()
        if need <= 0:
            return True
        if not self.large_tier(r):
            return False
        mine = idleness(p)
        for q in self.book.cpu_by_idleness(r, idleness):
            if need <= 0 or idleness(q) <= mine:
                break
            if self.pays(q, idleness.now):
                need -= q.kv_bytes
        return need <= 0

    def stores(self, p: Program, idleness: IdlenessAt) -> bool:
        """Whether ``p``, demoted now, goes to its replica's disk and has been away as
        long as its read back from there will take."""
        disk = self.disk  # the cheap test first: ``lands`` may sort a full disk queue
        return (disk is not None and self.away_s(p, idleness.now) >= disk.disk_reload_s(p)
                and disk.lands(p, idleness))

    def park_s(self, p: Program, now: float) -> float:
        """What parking ``p`` costs its replica, in seconds: the engine time its reload
        was measured to take (``reload_engine_s``; 0 where none was: the link's copy
        overlaps the compute), for each program that engine time delays (``delayed``),
        over the replica's unqueued share, as a drop's recompute is priced."""
        price = self.reload_engine_s(p) if self.reload_engine_s is not None else 0.0
        if price <= 0:
            return 0.0
        return _over(price * self.delayed(p.replica, now), self.unqueued(p.replica, now))

    def park_pays(self, p: Program, now: float) -> bool:
        """Whether ``p`` has been away at least as long as its park costs (``park_s``):
        the ski-rental rule on a park's price."""
        price = self.park_s(p, now)
        return price <= 0.0 or self.away_s(p, now) >= price

    def displaceable(self, p: Program, idleness: IdlenessAt) -> bool:
        return (self.pays(p, idleness.now)
                or (self.park_pays(p, idleness.now) and self.parks(p, idleness))
                or self.stores(p, idleness))

    def cpu_droppable(self, q: Program, idleness: IdlenessAt) -> bool:
        assert q.replica is not None
        return not self.large_tier(q.replica) or self.pays(q, idleness.now)


def _over(price: float, share: float) -> float:
    """``price`` paid back only during ``share`` of the time: ``price / share`` (inf at
    a share of 0, whatever the price; 0 stays 0)."""
    if price <= 0:
        return 0.0
    return price / share if share > 0 else math.inf
