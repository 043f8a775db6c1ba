"""MORI's promotions by scanning every held request (``mori`` module docstring): the
round's promotions as first written, the reference for the indexed ones.

The index (``mori_promote``) needs a held program's priority to stay fixed while it
waits (``MoriBook.incremental``). ``mori-no-exclusion`` counts the time a request is
held as acting time, so its priority moves: for it, ``ScanPromotion``, a part of
``MoriPolicy`` (its ``promotion`` field, in place of ``IndexedPromotion``), sorts the
held requests by the policy's promotion order (``MoriBook.priority``: ``mori_index``'s
``priority``, the paper's, or ``priority_smallest_first``) each round and tries each on every
replica. Its decisions are the reference for ``IndexedPromotion``'s
(``test_differential``, through ``tests/core/reference_policies.py``).
"""

from __future__ import annotations

from mori.core.ledger import ClusterSpec, Placement
from mori.core.policies.mori_index import AFFINE, Priority, priority
from mori.core.policies.mori_placement import ReplicaChoice
from mori.core.policies.mori_room import RoomMaker
from mori.core.policies.mori_round import Round
from mori.core.policies.moves import Moves
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["ScanPromotion"]


class ScanPromotion:
    """The plain promotions of one policy. ``ready``: the policy's held requests
    (shared)."""

    def __init__(self, placement: Placement, cluster: ClusterSpec, ready: dict[str, Program],
                 choice: ReplicaChoice, room: RoomMaker, moves: Moves,
                 priority: Priority = priority) -> None:
        self.priority = priority
        self.placement = placement
        self.cluster = cluster
        self.ready = ready
        self.choice = choice
        self.room = room
        self.moves = moves

    def run(self, rnd: Round) -> None:
        """(0) CPU- and disk-queue candidates onto their own replica, in priority order;
        (1, 2) the cacheless ones admitted as a batch and spread or packed; then what is
        left backfilled into free space. Only the first candidate that does not fit
        makes room (``RoomMaker.make``)."""
        pl = self.placement
        cap = self.cluster.gpu_bytes
        cands = [p for p in self.ready.values() if p.tier is not Tier.GPU]
        if not cands:
            return
        idleness = rnd.idleness
        cands.sort(key=lambda p: self.priority(p, idleness(p)))
        gpus = pl.gpu
        if rnd.held_for is not None:  # a request past the bound waits for it (mori_aged)
            rnd.reserve[rnd.held_for] = int(gpus[rnd.held_for].free())
        blocked = False
        # the most room any replica has beyond its reservation, or None when a move may
        # have changed it: once a candidate has been blocked, a cacheless one larger than
        # this fits nowhere and is passed over without a look at each replica
        most: float | None = None

        def fits_nowhere(c: Program) -> bool:
            return cap is not None and c.kv_bytes > cap  # refused up front by the simulator

        def place(c: Program, r: int) -> None:
            nonlocal most
            self.moves.place(c, r, rnd)
            most = None

        def place_or_make_room(c: Program) -> None:
            """Into free space if it fits; else the first such program may make room."""
            nonlocal blocked, most
            if blocked and c.tier is Tier.NONE:
                if most is None:
                    most = max(gq.free() - rnd.reserved(r) for r, gq in enumerate(gpus))
                if c.kv_bytes > most:
                    return
            r = self.choice.best_fit(c, rnd)
            if r is not None:
                place(c, r)
            elif not blocked:
                blocked = True
                self.room.make(c, rnd)
                most = None

        # (0) CPU-queue programs: their own replica (affinity), in priority order
        for c in (c for c in cands if c.tier in AFFINE and not fits_nowhere(c)):
            place_or_make_room(c)
        # (1, 2) cacheless programs: *who* is admitted follows the priority order, as
        # long as the free space of all replicas together holds them; *where*: the
        # largest first, each onto the replica with the most room if that places them
        # all (choice.spread), else onto the replica it fits tightest (Best-Fit-Decreasing)
        waiting = [c for c in cands if c.tier is Tier.NONE and not fits_nowhere(c)]
        room = sum(max(0.0, gq.free() - rnd.reserved(r)) for r, gq in enumerate(gpus))
        batch: list[Program] = []
        for c in waiting:
            if c.kv_bytes > room:
                break
            batch.append(c)
            room -= c.kv_bytes
        order = sorted(batch, key=lambda p: (-p.kv_bytes, p.ready_seq))
        spread = self.choice.spread(order, rnd)
        placed: set[str] = set()
        for c in order:
            r = spread[c.program_id] if spread is not None else self.choice.best_fit(c, rnd)
            if r is not None:
                place(c, r)
                placed.add(c.program_id)
        # what is left: backfill into free space; the first that does not fit (if no
        # CPU-queue program did) may make room
        for c in waiting:
            if c.program_id not in placed:
                place_or_make_room(c)
