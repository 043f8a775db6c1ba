"""``mori-spread``: MORI with load-aware placement across replicas (ours, not the paper's).

MORI places the cacheless programs it admits by Best-Fit-Decreasing: each onto the
fullest replica that holds it. Nothing weighs compute, so at low load on several
replicas it puts every program on one replica and leaves the others idle. This variant
spreads them while memory does not bind: as long as the GPU tiers, with the round's
admitted programs added, would be at most ``SPREAD_BELOW`` full, each goes, largest
first, to the replica running the fewest requests that has room (ties: the tightest
fit); beyond that, or when spreading would leave one without room, it packs them as
MORI does. With one replica it is MORI. Every other rule is MORI's.

It is a variant beside ``mori`` rather than a change to it because, measured on the
``paper`` sweep's three-replica settings, it costs MORI 2-5% at 50 and 80 programs per
replica with a 2x CPU tier (README, "Low load on three replicas").
"""

from __future__ import annotations

from mori.core.policies.mori import MoriPolicy
from mori.core.program import Program
from mori.core.types import Status

SPREAD_BELOW = 0.9
"""Programs are spread by load while the GPU tiers would be at most this full."""


class MoriSpreadPolicy(MoriPolicy):
    name = "mori-spread"
    description = "MORI, with admitted programs spread by load while memory does not bind"

    def _load(self, r: int) -> int:
        """The requests running on replica ``r``: its GPU queue's Reasoning programs
        (those forwarded earlier in this round included)."""
        return sum(1 for pid in self.placement.gpu[r].members
                   if self.programs[pid].status is Status.REASONING)

    def _spread(self, order: list[Program], reserve: list[int]) -> dict[str, int] | None:
        gpus = self.placement.gpu
        n = len(gpus)
        if n == 1 or not order:
            return None
        total = sum(gq.capacity or 0 for gq in gpus)
        if sum(gq.used for gq in gpus) + sum(c.kv_bytes for c in order) > SPREAD_BELOW * total:
            return None  # memory binds: pack
        free = [gq.free() - reserve[r] for r, gq in enumerate(gpus)]
        load = [self._load(r) for r in range(n)]
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
