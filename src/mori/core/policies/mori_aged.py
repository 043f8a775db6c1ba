"""Bounded waiting (``mori`` module docstring; ours, not the paper's, whose rule lets a
request wait for ever): requests held ``PolicyConfig.max_wait_s`` or longer are served
before the round's promotions, oldest first. ``WaitBound``, a part of ``MoriPolicy``
(its ``aged`` field), holds the rule and the request it last left waiting; the round
reserves the replica that request waits for (``Round.held_for``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mori.core.ledger import ClusterSpec, Placement
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_index import AFFINE
from mori.core.policies.mori_placement import ReplicaChoice
from mori.core.policies.mori_room import RoomMaker
from mori.core.policies.mori_round import Round
from mori.core.policies.moves import Moves
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["WaitBound"]


class WaitBound:
    """The bound on waiting of one policy. ``held_since(cutoff)`` gives the programs
    whose request has been held since ``cutoff`` or before, oldest first
    (``Policy.held_since``)."""

    def __init__(self, max_wait_s: float, held_since: Callable[[float], Iterator[Program]],
                 cluster: ClusterSpec, placement: Placement, book: MoriBook,
                 choice: ReplicaChoice, room: RoomMaker, moves: Moves) -> None:
        self.max_wait_s = max_wait_s
        self.held_since = held_since
        self.cluster = cluster
        self.placement = placement
        self.book = book
        self.choice = choice
        self.room = room
        self.moves = moves
        self.waiting: tuple[str, int] = ("", -1)
        """The request past the bound left waiting for its replica's running steps to
        end, and that replica (``serve``); kept from round to round."""

    def waits_for(self, ready: Callable[[str], bool]) -> int:
        """The replica the request last left waiting waits for, if it is still held
        (``ready``), else -1."""
        pid, r = self.waiting
        return r if ready(pid) else -1

    def serve(self, rnd: Round) -> int | None:
        """Requests held ``max_wait_s`` or longer go first, oldest first, each onto the
        replica that can hold it soonest; for it, that replica's Acting programs are
        demoted, most idle first. When one cannot be placed yet (its replica's running
        steps must end first), the rest wait behind it and its replica is returned: the
        round reserves that replica's free space for it, so nobody is promoted there
        ahead of it."""
        for c in self.held_since(rnd.now - self.max_wait_s):
            if c.tier is Tier.GPU:
                continue  # resident: forwarded this round
            r = self.replica_for(c)
            if r is None:
                continue  # larger than a whole GPU tier: it can never be placed
            gq = self.placement.gpu[r]
            for p in self.book.most_idle_acting(r, c.kv_bytes - gq.free(), rnd.idleness):
                self.room.offload(p, r, rnd, keep=c)
            if not gq.fits(c.kv_bytes):
                self.waiting = (c.program_id, r)
                return r
            self.moves.place(c, r, rnd)
        return None

    def replica_for(self, c: Program) -> int | None:
        """Where a request past the bound goes: a CPU-queue program to its own replica;
        a cacheless one where it fits now (the tightest), else where its room can be made
        by demoting Acting programs (the most such room), else where it waited last
        round (its Acting programs are gone already), else the most room then."""
        if c.tier in AFFINE:
            return c.replica
        if self.cluster.gpu_bytes is None:
            return self.choice.best_fit(c)
        if c.kv_bytes > self.book.max_kv:
            return None
        cap = self.book.cap  # each up replica's now (``mori_overcommit`` may change it)
        r = self.choice.best_fit(c)
        if r is not None:
            return r
        gpus, acting = self.placement.gpu, self.book.sums.acting
        best = max(range(len(gpus)), key=lambda q: (cap - gpus[q].used + acting[q], -q))
        if cap - gpus[best].used + acting[best] >= c.kv_bytes:
            return best
        pid, last = self.waiting
        return last if pid == c.program_id and last < len(gpus) else best
