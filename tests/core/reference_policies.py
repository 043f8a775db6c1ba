"""The straightforward policies: the reference the optimized core is checked against.

``mori.core.policies`` keeps its candidates, per-replica sums and queues that may be
over capacity up to date as events arrive, and a round looks only at what changed and
what can move (``IndexedRound.run``, ``mori_round``). The classes here are the same policies
with the plain loops they replaced: every held request scanned and sorted by priority
each round, every candidate tried on every replica, every queue checked for overflow,
every member of every replica looked at to make room; ThunderAgent's whole paused
queue sorted and grouped at every resume. ``test_differential`` runs both side by side
and asserts identical decision lists.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.policies import POLICIES, MoriPolicy
from mori.core.policies.mori import IdlenessAt
from mori.core.policies.thunderagent import BUFFER_PER_PROGRAM, ThunderAgentPolicy
from mori.core.policy import Policy
from mori.core.program import Program
from mori.core.types import Status, Tier


class StraightMori(MoriPolicy):
    """MORI's decision round as first written."""

    def _decide(self, now: float, out: list[Decision]) -> None:
        idleness = IdlenessAt(now)
        self._idleness = idleness  # the disk tier's demotions read it
        if self.rebalancer is not None:
            self.rebalancer.rebalance(now, out, idleness)
        self._fix_overflow(out, idleness)
        held_for = self.aged.serve(now, out, idleness) if self.aged is not None else None
        for p in sorted(self._ready.values(), key=lambda q: q.ready_seq):
            if p.tier is Tier.GPU:
                self._forward(p, now, out)
        self._promote_ready(now, out, idleness, held_for)

    def _fix_overflow(self, out: list[Decision], idleness: IdlenessAt) -> None:
        pl = self.placement
        for dq in pl.disk:  # a disk queue over capacity: its most idle to no tier
            if dq.over():
                for p in sorted((self.programs[pid] for pid in dq.members), key=idleness.desc):
                    if not dq.over():
                        break
                    Policy._demote_to(self, p, Tier.NONE, None, out)
        for r, gq in enumerate(pl.gpu):
            if gq.over():
                members = [self.programs[pid] for pid in gq.members]
                acting = [p for p in members if p.status is Status.ACTING]
                held = [p for p in members if p.status is Status.GATED]
                order = sorted(acting, key=idleness.desc) + sorted(held, key=idleness.desc)
                for p in order:
                    if not gq.over():
                        break
                    self.room.offload(p, r, out, idleness)
                assert not gq.over(), "reasoning programs alone exceed the GPU tier"
        for cq in pl.cpu:
            if cq.over():
                for p in sorted((self.programs[pid] for pid in cq.members), key=idleness.desc):
                    if not cq.over():
                        break
                    self._demote_to(p, Tier.NONE, None, out)

    def _make_room(self, c: Program, now: float, out: list[Decision], idleness: IdlenessAt,
                   reserve: list[int]) -> None:
        # the plan from every member of every replica (``RoomMaker.plan``), never from
        # the kept sums (``RoomMaker.plan_fast``, which the optimized round uses under
        # MORI's own ranking)
        plan = self.room.plan(c, now, idleness, reserve)
        if plan.room_later < c.kv_bytes:
            return
        r = plan.replica
        gq = self.placement.gpu[r]
        assert plan.acting is not None
        for p in plan.acting:
            if gq.free() - reserve[r] >= c.kv_bytes:
                break
            self.room.offload(p, r, out, idleness, keep=c)
        if gq.free() - reserve[r] >= c.kv_bytes:
            self._promote(c, r, out)
            self._forward(c, now, out)
            return
        reserve[r] = max(reserve[r], int(gq.free()))

    def _level(self, p: Program) -> int:
        if p.tier is Tier.CPU:
            return 0
        return 1 if p.returning else 2

    def _promote_ready(self, now: float, out: list[Decision], idleness: IdlenessAt,
                       held_for: int | None = None) -> None:
        pl = self.placement
        cap = self.cluster.gpu_bytes
        cands = [p for p in self._ready.values() if p.tier is not Tier.GPU]
        if not cands:
            return
        cands.sort(key=lambda p: (self._level(p), p.tokens if self._level(p) == 2 else 0,
                                  idleness(p), p.ready_seq))
        reserve = [0] * len(pl.gpu)
        if held_for is not None:
            reserve[held_for] = int(pl.gpu[held_for].free())
        blocked = False

        def fits_nowhere(c: Program) -> bool:
            return cap is not None and c.kv_bytes > cap

        def place(c: Program, r: int) -> None:
            self._promote(c, r, out)
            self._forward(c, now, out)

        def place_or_make_room(c: Program) -> None:
            nonlocal blocked
            r = self.choice.best_fit(c, reserve)
            if r is not None:
                place(c, r)
            elif not blocked:
                blocked = True
                self._make_room(c, now, out, idleness, reserve)

        for c in (c for c in cands if c.tier in (Tier.CPU, Tier.DISK) and not fits_nowhere(c)):
            place_or_make_room(c)
        waiting = [c for c in cands if c.tier is Tier.NONE and not fits_nowhere(c)]
        room = sum(max(0.0, gq.free() - reserve[r]) for r, gq in enumerate(pl.gpu))
        batch: list[Program] = []
        for c in waiting:
            if c.kv_bytes > room:
                break
            batch.append(c)
            room -= c.kv_bytes
        placed: set[str] = set()
        order = sorted(batch, key=lambda p: (-p.kv_bytes, p.ready_seq))
        spread = self.choice.spread(order, reserve)
        for c in order:
            r = spread[c.program_id] if spread is not None else self.choice.best_fit(c, reserve)
            if r is not None:
                place(c, r)
                placed.add(c.program_id)
        for c in waiting:
            if c.program_id not in placed:
                place_or_make_room(c)


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
