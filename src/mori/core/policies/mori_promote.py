"""MORI's promotions from the kept-up-to-date index (``mori`` module docstring; the
last phase but one of a round, ``mori_round``).

``IndexedPromotion``, a part of ``MoriPolicy`` (its ``promotion`` field), makes the same
decisions, in the same order, as the plain loop (``ScanPromotion.run``,
``mori_promote_scan``), looking only at candidates that can move and at replicas in
O(log R); and it finds a round blocked from a few sums (``blocked``).
``test_differential`` checks the decisions against the plain loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import chain
from typing import NamedTuple

from mori.core.decisions import Decision, Demote
from mori.core.ledger import Placement
from mori.core.ordered import Key
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_index import AFFINE
from mori.core.policies.mori_placement import ReplicaChoice
from mori.core.policies.mori_room import RoomMaker
from mori.core.policies.mori_round import Round
from mori.core.policies.moves import Moves
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["IndexedPromotion"]


class IndexedPromotion:
    """The indexed promotions of one policy. ``ready_gpu``: the policy's held requests
    of GPU-resident programs (shared)."""

    def __init__(self, placement: Placement, ready_gpu: dict[str, Program], book: MoriBook,
                 choice: ReplicaChoice, room: RoomMaker, moves: Moves) -> None:
        self.placement = placement
        self.ready_gpu = ready_gpu
        self.book = book
        self.choice = choice
        self.room = room
        self.moves = moves

    def run(self, rnd: Round) -> None:
        """``ScanPromotion.run`` from the kept-up-to-date index: the same decisions in
        the same order, looking only at candidates that can move and at replicas in
        O(log R). ``rnd.held_for``: a replica whose free space is reserved from the start
        (a request past the bound waits for it, ``WaitBound.serve``).

        The steps: (0) CPU-queue candidates onto their own replicas
        (``_cpu_candidates``); (1, 2) the cacheless ones admitted as a batch and spread
        or packed (``_admit_cacheless``); then what is left backfilled into free space
        (``_backfill``). Only the first candidate that does not fit makes room.
        """
        gpus = self.placement.gpu
        held_for = rnd.held_for
        self.book.attach(rnd)  # ``avail`` counts the round's reservations until detached
        walked = False
        try:
            if held_for is not None:
                rnd.reserve[held_for] = int(gpus[held_for].free())
                self.book.sync(held_for)
            self.book.flush()
            if not len(self.book.index):
                return
            first = self.book.index.cpu_all.first()
            if held_for is None and first is not None and self.blocked(first[1], first[2]):
                return
            rnd.walking = walked = True
            try:
                blocked, pushed = self._cpu_candidates(rnd)
                admitted = self._admit_cacheless(rnd, pushed)
                self._backfill(rnd, blocked, pushed, admitted)
            finally:
                rnd.walking = False
        finally:
            self.book.detach()
            if walked:
                self.book.flush()

    def _cpu_candidates(self, rnd: Round) -> tuple[bool, list[Program]]:
        """(0) CPU-queue candidates go back to their own replica (affinity), in priority
        order. Walking all of them, every one fits until the first that does not; that
        one makes room. After it only the replicas where one of their CPU candidates can
        fit are walked (``book.open``), and the decisions are emitted in the priority
        order, as the plain loop emits them.

        Returns whether a candidate was blocked (it made room: nobody else may), and the
        CPU candidates the room made pushed to Uncached (they join it ahead of the rest).
        """
        idx = self.book.index
        chunks: list[tuple[Key, list[Decision]]] = []
        fail: tuple[Key, Program, int] | None = None
        first = idx.cpu_all.first()
        if first is not None:  # the first already missing is the usual case
            fkey0, fkv0, fc0 = first
            assert fc0.replica is not None
            if self.book.avail[fc0.replica] < fkv0:
                fail = (fkey0, fc0, fc0.replica)
        for key, kv, c in idx.cpu_all if fail is None else ():
            r = c.replica
            assert r is not None
            if self.book.avail[r] < kv:
                fail = (key, c, r)
                break
            buf: list[Decision] = []
            self.moves.place(c, r, rnd.into(buf))
            chunks.append((key, buf))
        pushed: list[Program] = []
        if fail is not None:
            fkey, fc, fr = fail
            room_made: list[Decision] = []
            self.room.make(fc, rnd.into(room_made))
            chunks.append((fkey, room_made))
            # what still fits behind the first miss, on the replicas where some can
            for rc in sorted(self.book.open | {fr}):
                for k2, _, c2 in idx.cpu[rc].walk(lambda: self.book.avail[rc]):  # noqa: B023
                    if c2.tier in AFFINE and c2 is not fc:
                        buf = []
                        self.moves.place(c2, rc, rnd.into(buf))
                        chunks.append((k2, buf))
            if any(isinstance(d, Demote) and d.source is Tier.CPU for d in room_made):
                pushed = [c for _, _, c in idx.cpu[fr] if c.tier is Tier.NONE]
            chunks.sort(key=lambda t: t[0])
        for _, decided in chunks:
            rnd.out.extend(decided)
        return fail is not None, pushed

    def _admit_cacheless(self, rnd: Round, pushed: list[Program]) -> _Admitted:
        """(1, 2) Cacheless candidates: who is admitted follows the priority order while
        the free space of all replicas together holds them (the batch); where: the
        largest first, each onto the replica with the most room if that places them all
        (``ReplicaChoice.spread``), else onto the replica it fits tightest."""
        idx = self.book.index
        gpus = self.placement.gpu
        cap = self.book.cap
        # sum over replicas of max(0, free - reserve): only one can hold a reservation
        held_back = 0
        for r, v in rnd.reserve.items():
            held_back += min(int(gpus[r].free()), v)
        room = float(cap * (len(gpus) - len(self.placement.down))
                     - self.book.sums.gpu_used - held_back)
        head: list[Program] = []  # the batch's part among the pushed candidates
        last: Key | None = None  # the batch's last key in the Uncached index
        total = 0
        for c in pushed:
            if c.kv_bytes > room:
                break
            head.append(c)
            room -= c.kv_bytes
            total += c.kv_bytes
        else:
            # the batch's Uncached part matters only to spread (several replicas) or
            # if some Uncached candidate fits the most room; otherwise it places
            # nothing, and what is walked below without it is too large all the same
            if len(gpus) > 1 or idx.uncached_fits(self.book.avail.most()):
                last, in_index = idx.uncached.prefix(room)
                total += in_index
        n = len(gpus)
        # the batch's Uncached candidates left unplaced that may fit later (key order),
        # and the most room any replica had when they were chosen (None: unknown)
        unplaced: list[tuple[Key, Program]] = []
        most_then: int | None = None
        most = self.book.avail.most()
        if (n > 1 and total and all(c.kv_bytes <= most for c in head)
                and (last is None or idx.uncached_fits(most))):
            # spreading needs the whole batch (memory binds if it does not place it):
            # not tried when a member is known to fit nowhere (it packs then)
            batch = list(head)
            if last is not None:
                for k, _, c in idx.uncached:
                    if k > last:
                        break
                    batch.append(c)
            order = sorted(batch, key=lambda p: (-p.kv_bytes, p.ready_seq))
            spread = self.choice.spread(order, rnd)
            if spread is not None:  # every one is placed below
                most_then = self.book.avail.most()
            else:
                batch_waiting = [(k, c) for k, _, c in idx.uncached_up_to(
                    self.book.avail.most(), upto=last)] if last is not None else []
                unplaced, most_then = batch_waiting, self.book.avail.most()
        else:
            # packing: a batch member larger than the most room any replica has now
            # fits nowhere then or later in this round, so only the others are tried
            fit = [c for c in head if c.kv_bytes <= most]
            if last is not None and idx.uncached_fits(most):
                unplaced = [(k, c) for k, _, c in idx.uncached_up_to(most, upto=last)]
                fit += [c for _, c in unplaced]
            most_then = most
            order = sorted(fit, key=lambda p: (-p.kv_bytes, p.ready_seq))
            spread = None
        placed: set[str] = set()
        for c in order:
            r2 = (spread[c.program_id] if spread is not None
                  else self.book.avail.tightest(c.kv_bytes))
            if r2 is not None:
                self.moves.place(c, r2, rnd)
                placed.add(c.program_id)
        return _Admitted(placed, last, unplaced, most_then)

    def _backfill(self, rnd: Round, blocked: bool, pushed: list[Program],
                  admitted: _Admitted) -> None:
        """What is left goes into free space, in priority order. Until one does not fit,
        each is tried; the first that does not (if no CPU-queue candidate did) may make
        room. Once blocked, only a candidate no larger than the most room any replica
        has can move: those few are taken from the size order."""
        idx = self.book.index
        placed, last, unplaced, most_then = admitted
        after: Key | None = None  # the last Uncached index key looked at unblocked
        rest: list[Program] = pushed  # the pushed candidates left to look at
        if not blocked:
            rest = []
            ahead: Iterator[tuple[Key | None, int, Program]] = chain(
                ((None, i, c) for i, c in enumerate(pushed)),
                ((k, -1, c) for k, _, c in idx.uncached))
            for at, i, c in ahead:
                if c.program_id in placed:
                    continue
                r2 = self.book.avail.tightest(c.kv_bytes)
                if r2 is not None:
                    self.moves.place(c, r2, rnd)
                    continue
                blocked = True
                self.room.make(c, rnd)
                if i >= 0:
                    rest = pushed[i + 1:]
                else:
                    after = at
                break
            else:
                return  # every candidate was placed
        # blocked from here on: a candidate fits only if no larger than the most room.
        # The batch's part of the Uncached order (keys up to ``last``) holds only
        # placed candidates and those of ``unplaced``, unless room was made since
        # (the most room grew): then it is walked again
        most_now = self.book.avail.most()
        lo = after
        ahead_small: list[Program] = []
        if (last is not None and most_then is not None and most_now <= most_then
                and (after is None or after < last)):
            ahead_small = [c for k, c in unplaced
                           if (after is None or k > after) and c.kv_bytes <= most_now
                           and c.program_id not in placed]
            lo = last
        if not rest and not ahead_small and not idx.uncached_fits(most_now):
            return  # nothing left is small enough (and the most room only shrinks)
        small = chain(rest, ahead_small, idx.uncached_fitting(self.book.avail.most, after=lo))
        for c in small:
            if c.program_id not in placed and c.kv_bytes <= self.book.avail.most():
                r2 = self.book.avail.tightest(c.kv_bytes)
                assert r2 is not None
                self.moves.place(c, r2, rnd)

    def blocked(self, kv: int, c: Program) -> bool:
        """Whether the round would decide nothing, known from the first CPU candidate
        ``c`` (``kv`` bytes) and a few sums: the most common round at fleet scale.

        It holds when ``c`` does not fit its replica, which has no Acting program to
        demote for it; no other replica can fit one of its CPU candidates (none is
        open); and no Uncached candidate fits the most room any replica has, ``c``'s
        replica counted with none. No request is held on a GPU at this point (the
        round forwarded them), so ``c``'s replica has all of its capacity once its
        Reasoning programs' steps end: the full round would reserve all of its free
        space for ``c``, place nobody (nor spread anybody: nobody fits) and release
        the reservation at its end, leaving every structure as it found it. Only
        under MORI's own ranking (``mori_ranking``) and room making: an ablation that
        ranks otherwise always runs the full round. ``test_differential`` checks the
        decisions against the plain round, and ``test_blocked_round`` that a round
        this finds blocked, run in full, decides nothing.
        """
        r = c.replica
        assert r is not None and not self.ready_gpu
        avail, opened = self.book.avail, self.book.open
        if (avail[r] >= kv or len(self.book.gpu_acting[r])
                or not self.room.ranking.any_victim
                or type(self.room) is not RoomMaker
                or (opened and (len(opened) > 1 or r not in opened))):
            return False
        # r's room is all reserved: none is left for its smaller CPU candidates or for
        # an Uncached one while the round runs
        smallest = self.book.index.cpu[r].min_size()
        if smallest is not None and smallest <= 0:
            return False
        return not self.book.index.uncached_fits(avail.most_but(r, 0))


class _Admitted(NamedTuple):
    """What ``IndexedPromotion._admit_cacheless`` leaves to ``_backfill``."""

    placed: set[str]  # the programs placed
    last: Key | None  # the batch's last key in the Uncached index
    unplaced: list[tuple[Key, Program]]  # the batch's Uncached candidates left unplaced
    # that may fit later (key order)
    most_then: int | None  # the most room any replica had when they were chosen (None:
    # unknown)
