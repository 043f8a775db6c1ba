"""Where MORI puts an admitted program (``mori`` module docstring): its own replica for a
CPU-queue or disk-queue program (affinity: its KV is there); for the cacheless ones a round admits (the batch, largest
first), each onto the replica with the most free GPU room, as long as that places the
whole batch (memory does not bind); else Best-Fit-Decreasing, each onto the replica
where it fits most tightly, which leaves the largest holes for the rest.
``ReplicaChoice`` holds these choices, a part of the policy (``MoriPolicy.choice``); the
rules that call them are in ``mori.MoriPolicy`` and its other parts.

The paper places by Best-Fit-Decreasing always (``mori-pack`` keeps it), which puts a
handful of programs on one replica and, near capacity, overflows the fullest. With one
replica there is no choice and nothing changes. Measured: docs/results.md, "Placement
across replicas".

With ``PolicyConfig.spread_by_load`` the spreading first prefers the replica serving the
fewest requests that are not the policy's own (``Policy.set_foreign_loads``: in the
gateway, what the engines report beyond its own requests), then the most room.
"""

from __future__ import annotations

from collections.abc import Callable

from mori.core.ledger import Placement
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_index import AFFINE
from mori.core.policies.mori_round import Round
from mori.core.program import Program

__all__ = ["ReplicaChoice"]


class ReplicaChoice:
    """Which replica a promoted program goes to (see the module docstring).

    ``loads`` reads the replicas' loads when spreading by load (``spread_by_load``),
    else None. ``spreads``: False packs cacheless programs always (``mori-pack``, the
    paper's rule)."""

    def __init__(self, placement: Placement, book: MoriBook,
                 loads: Callable[[], tuple[int, ...] | None], spreads: bool = True) -> None:
        self.placement = placement
        self.book = book
        self.loads = loads
        self.spreads = spreads

    def replicas_for(self, c: Program) -> list[int]:
        if c.tier in AFFINE and c.replica is not None:
            return [c.replica]  # affinity: reload locally (from its CPU or disk queue)
        return list(range(len(self.placement.gpu)))

    def spread(self, order: list[Program], rnd: Round) -> dict[str, int] | None:
        """Where the admitted cacheless programs (``order``: largest first) go instead of
        Best-Fit-Decreasing (program id -> replica), or None to pack them: each onto the
        replica with the most room beyond the round's reservation (the lowest index
        among equals), if that places every one."""
        gpus = self.placement.gpu
        n = len(gpus)
        if not self.spreads or n == 1 or not order:
            return None
        loads = self.loads()
        if rnd.walking:  # the indexed round: the replicas' rooms are kept in order
            if loads is not None:
                return self.spread_by_load(order, [self.book.avail[r] for r in range(n)],
                                           loads)
            return self.spread_indexed(order)
        free = [gq.free() - rnd.reserved(r) for r, gq in enumerate(gpus)]
        if loads is not None:
            return self.spread_by_load(order, free, loads)
        out: dict[str, int] = {}
        for c in order:
            r = max(range(n), key=lambda r: (free[r], -r))
            if free[r] < c.kv_bytes:
                return None  # memory binds: pack
            out[c.program_id] = r
            free[r] -= c.kv_bytes
        return out

    @staticmethod
    def spread_by_load(order: list[Program], free: list[float], loads: tuple[int, ...]
                        ) -> dict[str, int] | None:
        """``spread`` with the replicas' loads (``spread_by_load``: requests not the
        policy's own): each program onto the replica with the fewest among those it
        fits, then the most room, then the lowest index; each placed program counts as
        one more request there. With equal loads these are ``spread``'s choices."""
        free = list(free)
        load = list(loads)
        out: dict[str, int] = {}
        for c in order:
            fits = [r for r in range(len(free)) if free[r] >= c.kv_bytes]
            if not fits:
                return None  # memory binds: pack
            r = min(fits, key=lambda r: (load[r], -free[r], r))
            out[c.program_id] = r
            free[r] -= c.kv_bytes
            load[r] += 1
        return out

    def spread_indexed(self, order: list[Program]) -> dict[str, int] | None:
        """``spread``'s choices from the book's ``avail`` (the free space beyond the
        round's reservation, as ``spread`` computes it): each placement is applied to the
        order to choose the next, then undone, as the caller places them."""
        avail = self.book.avail
        undo: list[tuple[int, int]] = []
        out: dict[str, int] | None = {}
        for c in order:
            r = avail.roomiest(c.kv_bytes)
            if r is None:
                out = None
                break
            undo.append((r, avail[r]))
            avail.set(r, avail[r] - c.kv_bytes)
            assert out is not None
            out[c.program_id] = r
        for r, room in reversed(undo):
            avail.set(r, room)
        return out

    def best_fit(self, c: Program, rnd: Round | None = None) -> int | None:
        """The replica ``c`` fits tightest (beyond ``rnd``'s reservation, if any), of
        those it may go to."""
        best: tuple[float, int] | None = None
        for r in self.replicas_for(c):
            left = (self.placement.gpu[r].free() - (rnd.reserved(r) if rnd is not None else 0)
                    - c.kv_bytes)
            if left >= 0 and (best is None or left < best[0]):
                best = (left, r)
        return None if best is None else best[1]
