"""Bounded waiting (``mori`` module docstring; ours, not the paper's, whose rule lets a
request wait for ever): requests held ``PolicyConfig.max_wait_s`` or longer are served
before the round's promotions, oldest first. ``MoriAged`` holds the rule; the round that
calls it, and reserves the replica one of them waits for, is ``mori.MoriPolicy``.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.policies.mori_book import IdlenessAt
from mori.core.policies.mori_room import MoriRoom
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["MoriAged"]


class MoriAged(MoriRoom):
    """MORI's bookkeeping, placement and room making plus the bound on waiting."""

    def _serve_aged(self, now: float, out: list[Decision], idleness: IdlenessAt) -> int | None:
        """Bounded waiting (ours, not the paper's): requests held ``max_wait_s`` or
        longer go first, oldest first, each onto the replica that can hold it soonest;
        for it, that replica's Acting programs are demoted, most idle first. When one
        cannot be placed yet (its replica's running steps must end first), the rest wait
        behind it and its replica is returned: the round reserves that replica's free
        space for it, so nobody is promoted there ahead of it."""
        assert self.config.max_wait_s is not None
        for c in self.held_since(now - self.config.max_wait_s):
            if c.tier is Tier.GPU:
                continue  # resident: forwarded this round
            r = self._aged_replica(c)
            if r is None:
                continue  # larger than a whole GPU tier: it can never be placed
            gq = self.placement.gpu[r]
            for p in self._most_idle_acting(r, c.kv_bytes - gq.free(), idleness):
                self._offload(p, r, out, idleness, keep=c)
            if not gq.fits(c.kv_bytes):
                self.book.aged_wait = (c.program_id, r)
                return r
            self._promote(c, r, out)
            self._forward(c, now, out)
        return None

    def _aged_replica(self, c: Program) -> int | None:
        """Where a request past the bound goes: a CPU-queue program to its own replica;
        a cacheless one where it fits now (the tightest), else where its room can be made
        by demoting Acting programs (the most such room), else where it waited last
        round (its Acting programs are gone already), else the most room then."""
        if c.tier is Tier.CPU:
            return c.replica
        if self.cluster.gpu_bytes is None:
            return self.choice.best_fit(c, [0] * len(self.placement.gpu))
        cap = self.cluster.gpu_bytes
        if c.kv_bytes > cap:
            return None
        r = self.choice.best_fit(c, [0] * len(self.placement.gpu))
        if r is not None:
            return r
        gpus, acting = self.placement.gpu, self.book.sums.acting
        best = max(range(len(gpus)), key=lambda q: (cap - gpus[q].used + acting[q], -q))
        if cap - gpus[best].used + acting[best] >= c.kv_bytes:
            return best
        pid, last = self.book.aged_wait
        return last if pid == c.program_id and last < len(gpus) else best
