"""The straightforward policies: the reference the optimized core is checked against.

``mori.core.policies`` keeps its candidates, per-replica sums and queues that may be
over capacity up to date as events arrive, and a round looks only at what changed and
what can move (``IndexedPromotion.run``, ``mori_promote``). The classes here are the same
policies with the plain loops they replaced: every held request scanned and sorted by
priority each round, every candidate tried on every replica (``ScanPromotion``), every
queue checked for overflow, every member of every replica looked at to make room;
ThunderAgent's whole paused queue sorted and grouped at every resume. ``test_differential`` runs both side by side
and asserts identical decision lists.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.policies import POLICIES, MoriPolicy
from mori.core.policies.mori_index import AFFINE
from mori.core.policies.mori_promote_scan import ScanPromotion
from mori.core.policies.mori_round import Round
from mori.core.policies.thunderagent import BUFFER_PER_PROGRAM, ThunderAgentPolicy
from mori.core.policy import Policy
from mori.core.program import Program
from mori.core.types import Status, Tier


class StraightMori(MoriPolicy):
    """MORI's decision round as first written: every queue checked for overflow at every
    round, every member of a replica looked at to make room (``RoomMaker.plan``), and
    the promotions by scanning every held request (``ScanPromotion``, the reference of
    the indexed ones)."""

    def _round(self, now: float, out: list[Decision]) -> None:
        # the round alone: what runs around it (the adaptive GPU tier, mori_overcommit)
        # is MoriPolicy's, the same for both
        rnd = Round.at(now, out)
        if self.rebalancer is not None:
            self.rebalancer.rebalance(rnd)
        self._fix_overflow(rnd)
        if self.aged is not None:
            rnd.held_for = self.aged.serve(rnd)
        for p in sorted(self._ready.values(), key=lambda q: q.ready_seq):
            if p.tier is Tier.GPU:
                self._forward(p, now, out)
        ScanPromotion(self.placement, self.cluster, self._ready, self.choice, self.room,
                      self.moves, self.book.priority).run(rnd)
        if self.replica_room:  # each replica's first parked candidate, by a full scan
            heads: dict[int, Program] = {}
            for p in sorted(self._ready.values(),
                            key=lambda q: self.book.priority(q, rnd.idleness(q))):
                if p.tier in AFFINE and p.replica is not None:
                    heads.setdefault(p.replica, p)
            self.room.each_replica(sorted(heads.items()), rnd)

    def _fix_overflow(self, rnd: Round) -> None:
        pl = self.placement
        for dq in pl.disk:  # a disk queue over capacity: its most idle to no tier
            if dq.over():
                for p in sorted((self.programs[pid] for pid in dq.members),
                                key=rnd.idleness.desc):
                    if not dq.over():
                        break
                    self._demote_to(p, Tier.NONE, None, rnd.out)
        for r, gq in enumerate(pl.gpu):
            if gq.over():
                members = [self.programs[pid] for pid in gq.members]
                acting = [p for p in members if p.status is Status.ACTING]
                held = [p for p in members if p.status is Status.HELD]
                order = (sorted(acting, key=rnd.idleness.desc)
                         + sorted(held, key=rnd.idleness.desc))
                for p in order:
                    if not gq.over():
                        break
                    self.room.offload(p, r, rnd)
                assert not gq.over(), "reasoning programs alone exceed the GPU tier"
        for cq in pl.cpu:
            if cq.over():
                for p in sorted((self.programs[pid] for pid in cq.members),
                                key=rnd.idleness.desc):
                    if not cq.over():
                        break
                    self._drop(p, rnd)


class StraightThunderAgent(ThunderAgentPolicy):
    """ThunderAgent's choice of whom to resume as first written: the whole paused queue
    sorted and split into groups at every check, every program of every group tried."""

    def _to_resume(self, total: float) -> list[Program]:
        order = sorted(self.paused.items(), key=lambda kv: kv[1].tokens)
        groups: tuple[list[Program], list[Program], list[Program]] = ([], [], [])
        for pid, _info in order:
            p = self.programs[pid]
            if self.requests.get(pid, 0) == 1:
                groups[1].append(p)  # new
            elif self._reasoning(p):
                groups[0].append(p)  # a held request, ran before
            else:
                groups[2].append(p)  # no request
        chosen: list[Program] = []
        cumulative = 0
        for p in (*groups[0], *groups[1], *groups[2]):
            need = p.tokens + BUFFER_PER_PROGRAM
            if cumulative + need <= total:
                chosen.append(p)
                cumulative += need
        return chosen


def reference(name: str) -> type[Policy]:
    """The registered policy ``name`` with the straightforward decision round."""
    cls = POLICIES.get(name)
    for straight in (StraightMori, StraightThunderAgent):
        base = straight.__mro__[1]
        if issubclass(cls, base):
            # the policy's own overrides (ablations, variants) stay; the round is
            # the straightforward one
            return type(f"Reference{cls.__name__}", (_round_of(straight), cls), {})
    return cls  # no optimized round (smg): its own code is the reference


def _round_of(straight: type[Policy]) -> type:
    """A mixin holding only the methods ``straight`` defines itself."""
    own = {k: v for k, v in vars(straight).items() if callable(v)}
    return type(f"{straight.__name__}Round", (), own)
