"""Where MORI puts an admitted program (``mori`` module docstring): its own replica for a
CPU-queue program (affinity), Best-Fit-Decreasing for cacheless ones, or, while memory
does not bind, spread by load. ``MoriPlacement`` holds these choices; the round that
calls them is ``mori.MoriPolicy``.
"""

from __future__ import annotations

from mori.core.policies.mori_state import MoriState
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["SPREAD_BELOW", "MoriPlacement"]

SPREAD_BELOW = 0.7
"""Admitted programs are spread by load while the GPU tiers would be at most this full."""


class MoriPlacement(MoriState):
    """MORI's bookkeeping (``MoriState``) plus the choice of a replica for a program."""

    def _replicas_for(self, c: Program) -> list[int]:
        if c.tier is Tier.CPU and c.replica is not None:
            return [c.replica]  # affinity: reload locally
        return list(range(len(self.placement.gpu)))

    def _spread(self, order: list[Program], reserve: list[int]) -> dict[str, int] | None:
        """Where the admitted cacheless programs go instead of Best-Fit-Decreasing
        (program id -> replica), or None to pack them: spread while memory does not
        bind, each to the replica holding the fewest programs that has room."""
        gpus = self.placement.gpu
        n = len(gpus)
        if n == 1 or not order:
            return None
        total = (self.cluster.gpu_bytes or 0) * n
        if self._sums.gpu_used + sum(c.kv_bytes for c in order) > SPREAD_BELOW * total:
            return None  # memory binds: pack
        if self._frozen:  # the indexed round: the replicas' loads and rooms are kept
            return self._spread_indexed(order)
        free = [gq.free() - reserve[r] for r, gq in enumerate(gpus)]
        # a replica's load: the programs it holds. With few programs most are Acting at
        # any instant, so the count balances their steps to come better than the
        # requests running now
        load = [len(gq.members) for gq in gpus]
        out: dict[str, int] = {}
        for c in order:
            fits = [r for r in range(n) if free[r] >= c.kv_bytes]
            if not fits:
                return None
            r = min(fits, key=lambda r: (load[r], free[r] - c.kv_bytes, r))
            out[c.program_id] = r
            free[r] -= c.kv_bytes
            load[r] += 1
        return out

    def _spread_indexed(self, order: list[Program]) -> dict[str, int] | None:
        """``_spread``'s choices from ``LoadOrder`` (its room is the free space beyond
        the round's reservation, as ``_spread`` computes it): each placement is applied
        to the order to choose the next, then undone, as the caller places them."""
        loads = self._fresh_loads()
        undo: list[tuple[int, int, int]] = []
        out: dict[str, int] | None = {}
        for c in order:
            r = loads.best(c.kv_bytes)
            if r is None:
                out = None
                break
            load, room = loads[r]
            undo.append((r, load, room))
            loads.set(r, load + 1, room - c.kv_bytes)
            assert out is not None
            out[c.program_id] = r
        for r, load, room in reversed(undo):
            loads.set(r, load, room)
        return out

    def _best_fit(self, c: Program, reserve: list[int]) -> int | None:
        best: tuple[float, int] | None = None
        for r in self._replicas_for(c):
            left = self.placement.gpu[r].free() - reserve[r] - c.kv_bytes
            if left >= 0 and (best is None or left < best[0]):
                best = (left, r)
        return None if best is None else best[1]
