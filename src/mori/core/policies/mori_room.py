"""Where room is made on a GPU and who leaves to make it (``mori`` module docstring).

``RoomMaker``, a part of ``MoriPolicy`` (its ``room`` field), holds: where a demoted
program goes (``offload``); the plan of which replica makes room for a candidate, by the
policy's ranking (``mori_ranking``); making that room, or reserving what is free until
running steps end (``make``); and emptying a queue over capacity (``fix_overflow``, ``overflow_order``). It reads the policy's book (``mori_book``) and replica choice
(``mori_placement``) and changes nothing but through the policy's moves (``moves``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from mori.core.decisions import Demote
from mori.core.ledger import Placement
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_placement import ReplicaChoice
from mori.core.policies.mori_ranking import Ranking
from mori.core.policies.mori_round import IdlenessAt, Round
from mori.core.policies.moves import Moves
from mori.core.program import Program
from mori.core.types import Status, Tier

__all__ = ["RoomMaker", "RoomPlan"]


class RoomMaker:
    """Room making on the GPUs of one policy (see the module docstring).

    ``placement``, ``programs`` and ``ready_gpu`` (the held requests of GPU-resident
    programs) are the policy's own, shared; ``ranking`` says who may leave for whom.
    """

    def __init__(self, placement: Placement, programs: dict[str, Program],
                 ready_gpu: dict[str, Program], book: MoriBook, choice: ReplicaChoice,
                 ranking: Ranking, moves: Moves) -> None:
        self.placement = placement
        self.programs = programs
        self.ready_gpu = ready_gpu
        self.book = book
        self.choice = choice
        self.ranking = ranking
        self.moves = moves

    def offload(self, p: Program, replica: int, rnd: Round, keep: Program | None = None) -> None:
        """Demote ``p`` off the GPU of ``replica``: to CPU if it (can be made to) fit,
        else it leaves the faster tiers (``Moves.drop``: to the replica's disk where
        that tier takes it, else to none).

        ``keep`` (the program being made room for) is never pushed out of the CPU.
        Under a ranking that does not rank the CPU tier (``Ranking.ranks_cpu``) nobody
        is pushed out of it: ``p`` goes to no tier if it does not fit.
        """
        idleness = rnd.idleness
        cq = self.placement.cpu[replica]
        if not cq.fits(p.kv_bytes) and cq.capacity and self.ranking.ranks_cpu:
            need = p.kv_bytes - int(cq.free())
            mine = idleness(p)
            victims = []
            for q in self.book.cpu_by_idleness(replica, idleness):
                if need <= 0 or idleness(q) <= mine:
                    break
                if q is keep or not self.ranking.cpu_droppable(q, idleness):
                    continue
                victims.append(q)
                need -= q.kv_bytes
            if need <= 0:
                for q in victims:
                    self.moves.drop(q, rnd)
        if cq.fits(p.kv_bytes) and cq.capacity:
            self.moves.demote_to(p, Tier.CPU, replica, rnd.out)
        else:
            self.moves.drop(p, rnd)

    def fix_overflow(self, rnd: Round) -> None:
        """Bring every queue over capacity back to it: a GPU queue's Acting programs
        leave, then its held ones, the most idle first (``overflow_order``); a CPU
        queue's programs go to no tier, the most idle first. Only a queue where a
        program grew since the last round can be over capacity (``book.grown``)."""
        if not self.book.grown:
            return
        grown: list[int] = []
        grown_cpu: list[int] = []
        for t, r in self.book.grown:
            if t is Tier.GPU:
                grown.append(r)
            elif t is Tier.CPU:
                grown_cpu.append(r)
        grown.sort()
        grown_cpu.sort()
        self.book.grown.clear()
        pl = self.placement
        for r in grown:
            gq = pl.gpu[r]
            if gq.over():
                for p in self.overflow_order(r, rnd.idleness):
                    if not gq.over():
                        break
                    self.offload(p, r, rnd)
                assert not gq.over(), "reasoning programs alone exceed the GPU tier"
        for r in grown_cpu:
            cq = pl.cpu[r]
            if cq.over():
                for p in sorted((self.programs[pid] for pid in cq.members),
                                key=rnd.idleness.desc):
                    if not cq.over():
                        break
                    self.moves.drop(p, rnd)

    def overflow_order(self, r: int, idleness: IdlenessAt) -> list[Program]:
        """Who leaves an overfull GPU queue first: its Acting programs, then its held
        ones, the most idle first (ties: the later request first); the Acting ones cut
        to what must leave where the book keeps them in order
        (``MoriBook.acting_to_leave``). The held ones' idleness is computed in full: they
        are forwarded later in the round, and a later look at their idleness must find
        the value computed here."""
        gq = self.placement.gpu[r]
        assert gq.capacity is not None
        order = self.book.acting_to_leave(r, gq.used - gq.capacity, idleness)
        held = sorted((p for p in self.ready_gpu.values() if p.replica == r), key=idleness.desc)
        return order + held

    def plan_fast(self, c: Program, rnd: Round) -> RoomPlan:
        """``plan`` when every Acting and Reasoning program may make room (MORI's
        own rules), from the per-replica sums and orders instead of the members."""
        gpus, sums = self.placement.gpu, self.book.sums
        idleness = rnd.idleness
        if c.tier is Tier.NONE and len(gpus) > 1:
            # room is made once a round; a replica may be reserved already for a request
            # past the bound (its _avail counts the reservation, its _room does not)
            kv = c.kv_bytes
            if self.book.fresh_room().most() >= kv:  # some replica can make room now
                best: tuple[bool, int] | None = None  # (lands in DRAM, free space)
                ties: list[int] = []
                for avail, rr in self.book.avail:  # (the most free space, then lowest index)
                    if best is not None and best[0] and avail < best[1]:
                        break  # nothing later beats it
                    if avail + sums.acting[rr] >= kv:
                        key = (self.cpu_takes(rr, kv - avail), avail)
                        if best is None or key > best:
                            best, ties = key, [rr]
                        elif key == best:
                            ties.append(rr)
                if best is not None:
                    r = ties[0] if len(ties) == 1 else max(
                        ties, key=lambda q: (self.first_victim_idleness(q, kv - best[1], idleness),
                                             -q))
                    return RoomPlan(r, 0.0, float(self.book.avail[r] + sums.acting[r]
                                                   + sums.reasoning[r]), None)
            if not self.ready_gpu:  # no held request on a GPU: every replica would have
                # all of its room later, but for a reservation: the first unreserved one
                # where the demoted keep their KV in DRAM, else the first unreserved
                held = rnd.reserve
                up = [q for q in range(len(gpus))
                      if not held.get(q) and q not in self.placement.down]
                if up:
                    r0 = next((q for q in up if self.cpu_takes(q, kv - gpus[q].free())),
                              up[0])
                    return RoomPlan(r0, 0.0, float(self.book.cap), None)
        # (lands in DRAM, free beyond reservation, the first victim's idleness, -replica),
        # (room later, lands, -replica)
        now_best: tuple[bool, float, float, int] | None = None
        later_best: tuple[float, bool, int] | None = None
        for r in self.choice.replicas_for(c):
            free = gpus[r].free() - rnd.reserved(r)
            room = free + sums.acting[r]
            later = room + sums.reasoning[r]
            lands = self.cpu_takes(r, c.kv_bytes - free)
            if room >= c.kv_bytes:
                plan = (lands, free, self.first_victim_idleness(r, c.kv_bytes - free, idleness), -r)
                if now_best is None or plan > now_best:
                    now_best = plan
            if later_best is None or (later, lands, -r) > later_best:
                later_best = (later, lands, -r)
        assert later_best is not None
        if now_best is not None:
            r = -now_best[3]
            later = gpus[r].free() - rnd.reserved(r) + sums.acting[r] + sums.reasoning[r]
            return RoomPlan(r, 0.0, later, None)
        return RoomPlan(-later_best[2], 0.0, later_best[0], None)

    def plan(self, c: Program, rnd: Round) -> RoomPlan:
        """Where room for ``c`` is made. Among the replicas where it can be made now: one
        whose CPU tier takes what is demoted (``cpu_takes``), then the one with the most
        free space (the fewest demotions), then the one whose first program to leave is
        the most idle (``first_victim_idleness``), then the lowest index. Else the one
        with the most room once its running steps end (then whose CPU tier takes what
        is demoted, then the lowest index)."""
        ranking, idleness = self.ranking, rnd.idleness
        every = ranking.any_victim  # victim_ok holds for all: no idleness to compute
        mine = 0.0 if every else idleness(c)
        kv = c.kv_bytes
        gpus, cpus, reserve = self.placement.gpu, self.placement.cpu, rnd.reserve
        # one pass; the victims are sorted only for the replica chosen (and the first
        # victim's idleness read only where (lands, free) ties)
        now_ok: list[tuple[bool, float, int, list[Program], float, float]] = []
        later_best: tuple[float, bool, int] | None = None
        later_plan: RoomPlan | None = None
        book = self.book
        gpu_acting, displaceable = book.gpu_acting, ranking.displaceable
        for r in self.choice.replicas_for(c):
            gq = gpus[r]
            if every:  # the replica's Acting programs, as the book keeps them
                ga = gpu_acting[r]
                acting = [p for p in ga.programs() if displaceable(p, idleness)] if len(ga) else []
                reasoning = book.reasoning_bytes(r)
            else:
                members = [self.programs[pid] for pid in gq.members]
                acting = [p for p in members if p.status is Status.ACTING
                          and ranking.victim_ok(idleness(p), mine)
                          and ranking.displaceable(p, idleness)]
                reasoning = sum(p.kv_bytes for p in members if p.status is Status.REASONING
                                and ranking.victim_ok(idleness(p), mine))
            free = gq.free() - reserve.get(r, 0)
            room = free + sum(p.kv_bytes for p in acting)
            cq = cpus[r]
            lands = bool(cq.capacity) and cq.free() >= kv - free
            if room >= kv:
                now_ok.append((lands, free, r, acting, room, room + reasoning))
            elif not now_ok:
                key = (room + reasoning, lands, -r)
                if later_best is None or key > later_best:
                    later_best, later_plan = key, RoomPlan(r, room, room + reasoning, acting)
        if now_ok:  # placeable now: where the demoted keep their KV in DRAM, then the
            # fewest demotions, then where the first to leave is the most idle
            top = max((t[0], t[1]) for t in now_ok)
            tied = [t for t in now_ok if (t[0], t[1]) == top]
            if len(tied) > 1:
                def first_idleness(t: tuple[bool, float, int, list[Program], float,
                                            float]) -> float:
                    if kv - t[1] <= 0:
                        return math.inf
                    return idleness(min(t[3], key=idleness.desc)) if t[3] else -math.inf
                pick = max(tied, key=lambda t: (first_idleness(t), -t[2]))
            else:
                pick = tied[0]
            return RoomPlan(pick[2], pick[4], pick[5], sorted(pick[3], key=idleness.desc))
        # only after running steps end: the replica with the most room then
        assert later_plan is not None
        return later_plan._replace(acting=sorted(later_plan.acting or [], key=idleness.desc))

    def first_victim_idleness(self, r: int, need: float, idleness: IdlenessAt) -> float:
        """The idleness of the first program demoted to make ``need`` bytes of room on
        replica ``r``'s GPU: its most idle Acting program (inf when none must leave,
        -inf when it has none).

        Among replicas with equal free space (every GPU tier filled exactly), room is
        made where that program is the most idle: the ranking that decides who leaves
        a replica also decides which replica. (The lowest index, as before, took every
        new program once the tiers were full: one replica served all the work while the
        other kept its idle programs.)"""
        if need <= 0:
            return math.inf
        acting = self.book.gpu_acting[r]
        if not len(acting):
            return -math.inf
        return idleness(next(acting.descending(idleness, idleness.now)))

    def cpu_takes(self, r: int, need: float) -> bool:
        """Whether replica ``r``'s CPU tier has ``need`` bytes free: what making that
        much room on its GPU demotes keeps its KV in DRAM, nobody dropped for it.

        Ours, not the paper's (which makes room where the fewest programs must leave):
        with every GPU tier full, that chose the lowest index each time, whose full CPU
        tier then pushed program after program to no tier while another replica's CPU
        tier held nothing. A demoted program cannot move to another replica's DRAM (its
        KV is on this replica's GPU), so the choice is made here, where room is made.
        An estimate: demotions go by whole programs, so they may free more than ``need``.
        """
        cq = self.placement.cpu[r]
        return bool(cq.capacity) and cq.free() >= need

    def make(self, c: Program, rnd: Round) -> None:
        """Make room for ``c`` where ``plan`` says (``plan_fast`` under MORI's own ranking
        while the index is walked) and place it; or, if running steps must end first,
        demote the Acting programs now and reserve the replica's free space for ``c``
        for the rest of the round; or, if even that cannot make room, demote nobody."""
        plan = self.plan_fast(c, rnd) if rnd.walking and self.ranking.own else self.plan(c, rnd)
        if plan.room_later < c.kv_bytes:
            return  # cannot be made to fit yet: demote nobody, wait
        r = plan.replica
        gq = self.placement.gpu[r]
        acting = plan.acting
        if acting is None:  # every Acting program of the replica may go, most idle first:
            # as many as it takes
            acting = self.book.most_idle_acting(
                r, c.kv_bytes - (gq.free() - rnd.reserved(r)), rnd.idleness)
        for p in acting:
            if gq.free() - rnd.reserved(r) >= c.kv_bytes:
                break
            self.offload(p, r, rnd, keep=c)
        if gq.free() - rnd.reserved(r) >= c.kv_bytes:
            self.moves.place(c, r, rnd)
            return
        # the Reasoning programs will make up the rest when their steps end (lazy
        # demotion: a later round demotes them as Acting programs); until then hold
        # what is free for c
        rnd.reserve[r] = max(rnd.reserved(r), int(gq.free()))
        self.book.sync(r)

    def each_replica(self, heads: list[tuple[int, Program]], rnd: Round) -> None:
        """Every other replica makes room for its own first held candidate
        (``heads``: (replica, the first in priority order of the held programs parked or
        kept on disk there), ascending by replica), if that room can be made now.

        The promotions let only the first candidate that does not fit make room: with
        one replica that keeps the priority order. Across replicas it held a request
        on one replica, whose Acting programs could make room at once, behind a
        candidate of another waiting for running steps to end (measured:
        docs/results.md, "Room on every replica"). A parked program goes back only to
        its own replica, so its room competes with nobody else's. Passed over: a
        replica where room was made or reserved this round, and one where the room
        can be made only once running steps end (nothing is reserved here)."""
        touched = set(rnd.reserve)
        if rnd.held_for is not None:
            touched.add(rnd.held_for)
        touched.update(d.replica for d in rnd.out
                       if isinstance(d, Demote) and d.source is Tier.GPU)
        down = self.placement.down
        acting = self.book.sums.acting
        for r, c in heads:
            if r in touched or r in down or c.tier is Tier.GPU:
                continue
            gq = self.placement.gpu[r]
            if gq.free() - rnd.reserved(r) + acting[r] < c.kv_bytes:
                continue  # not even with every Acting program gone (cheap test first)
            plan = self.plan(c, rnd)
            if plan.replica != r or plan.room_now < c.kv_bytes:
                continue
            for p in plan.acting or ():
                if gq.free() - rnd.reserved(r) >= c.kv_bytes:
                    break
                self.offload(p, r, rnd, keep=c)
            if gq.free() - rnd.reserved(r) >= c.kv_bytes:
                self.moves.place(c, r, rnd)


class RoomPlan(NamedTuple):
    """How one replica could make room for a candidate (``make``)."""

    replica: int
    room_now: float  # free space beyond the reservation, plus the Acting victims' KV
    room_later: float  # the same, once the Reasoning victims' steps have ended
    acting: list[Program] | None  # the Acting victims, most idle first (None: all of
    # the replica's Acting programs, sorted when needed)
