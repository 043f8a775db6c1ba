"""Work conservation (ours, not the paper's): a replica whose engine has nothing to run
takes a held request at once. ``IdleFill``, a part of ``MoriPolicy`` (its ``idle_fill``
field, ``PolicyConfig.fill_idle``).

MORI holds a request while its program's KV does not fit beside the Acting programs on
the GPU whose leaving does not pay yet (``mori_ranking.ReturnCost``). On a busy replica
that protects the steps that run; on an idle one it only wastes the engine: holding the
request costs its whole wait of engine time for certain, while making room costs the
programs that leave a return that may never come. So after the round's promotions, a
replica with no step running (as the policy forwarded them, ``ReplicaLoad.running``;
and, where the gateway reads it, no other client's request, ``Policy.foreign_loads``)
takes the oldest held request that can go there: a program parked or kept on disk there,
or one with no KV anywhere, whose context fits the replica's GPU tier once Acting
programs leave. They leave, the most idle first, at once if they all park in the free
room of the replica's CPU tier: a park waits out no reload price on an idle engine
(``ReturnCost.park_pays``). Those that find no room there are dropped only once the held
request has waited as long as their recomputes will take (``drops_s``): the ski-rental
rule of a drop (``ReturnCost.pays``) read from the other side, since an idle engine
loses for certain every second the request waits, and a drop costs its recompute only
if the program returns. One request per idle replica per round: once it runs, the
replica is no longer idle.

Off by default: a wash on the simulated GPUs, a gain where a real engine is fast enough
to stand idle between requests. Measured: docs/results.md, "Filling an idle replica
(`--fill-idle`)".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mori.core.ledger import Placement
from mori.core.load import ReplicaLoad
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_index import AFFINE
from mori.core.policies.mori_room import RoomMaker
from mori.core.policies.mori_round import Round
from mori.core.policies.moves import Moves
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["IdleFill"]


class IdleFill:
    """The work-conserving rule of one policy (the module docstring).
    ``held_since(cutoff)``: the programs holding a request since ``cutoff`` or before,
    oldest first (``Policy.held_since``); ``foreign(r)``: requests of other clients on
    replica ``r`` as last reported (0 when unknown)."""

    def __init__(self, placement: Placement, book: MoriBook, load: ReplicaLoad,
                 held_since: Callable[[float], Iterator[Program]],
                 foreign: Callable[[int], int], room: RoomMaker, moves: Moves,
                 recompute_s: Callable[[Program], float]) -> None:
        self.recompute_s = recompute_s
        self.placement = placement
        self.book = book
        self.load = load
        self.held_since = held_since
        self.foreign = foreign
        self.room = room
        self.moves = moves

    def idle(self, r: int) -> bool:
        """Whether replica ``r`` is up and its engine has nothing to run."""
        return (r not in self.placement.down and self.load.running(r) == 0
                and self.foreign(r) == 0 and bool(self.placement.gpu[r].capacity))

    def fill(self, rnd: Round) -> None:
        """Each idle replica takes the oldest held request that can go there."""
        gpus = self.placement.gpu
        idle = [r for r in range(len(gpus)) if self.idle(r)]
        if not idle:
            return
        for c in self.held_since(rnd.now):
            if not idle:
                return
            if c.tier is Tier.GPU:
                continue  # resident: forwarded this round already
            r = self._where(c, idle)
            if r is None:
                continue
            gq = gpus[r]
            leave = self.book.most_idle_acting(r, c.kv_bytes - gq.free(), rnd.idleness)
            if rnd.now - c.ready_at < self.drops_s(leave, r):
                continue  # the wait has not yet paid for the recomputes of the drops
            for p in leave:
                self.room.offload(p, r, rnd, keep=c)
            self.moves.place(c, r, rnd)
            idle.remove(r)

    def drops_s(self, leave: list[Program], r: int) -> float:
        """The engine seconds the recomputes of those of ``leave`` (most idle first) that
        find no free room in replica ``r``'s CPU tier will take, should they return."""
        cq = self.placement.cpu[r]
        free = cq.free() if cq.capacity else 0
        price = 0.0
        for p in leave:
            if p.kv_bytes <= free:
                free -= p.kv_bytes
            else:
                price += self.recompute_s(p)
        return price

    def _where(self, c: Program, idle: list[int]) -> int | None:
        """The idle replica ``c`` can go to: its own where its KV is kept (CPU or disk
        tier), else the one with the most room that its context fits once the Acting
        programs leave (None: none)."""
        gpus = self.placement.gpu
        if c.tier in AFFINE:
            return c.replica if c.replica in idle and self._fits(c, c.replica) else None
        fits = [r for r in idle if self._fits(c, r)]
        return max(fits, key=lambda r: (gpus[r].free(), -r)) if fits else None

    def _fits(self, c: Program, r: int) -> bool:
        """Whether ``c`` fits on ``r``'s GPU once every Acting program there leaves (no
        step runs on an idle replica, so every other program there is Acting or held)."""
        gq = self.placement.gpu[r]
        return gq.capacity is None or c.kv_bytes <= gq.free() + self.book.sums.acting[r]
