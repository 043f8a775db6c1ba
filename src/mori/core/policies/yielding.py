"""``mori-yield``: MORI whose affinity may yield (ours, not the paper's).

MORI sends a CPU-queue program back to its own replica, where its KV waits to be
reloaded, however long that replica stays full. When only running steps fill it (no
Acting program is left to demote: the program cannot get in this round whatever MORI
does) and another replica has room for it now, the program may instead drop its CPU
copy and be recomputed there. The cost model's estimates decide when, by the
ski-rental rule again: the program waits at home until it has waited as long as a
recompute costs beyond a reload (its context over ``recompute_tok_s``, less its KV over
``reload_gbps``); then it moves. A replica that frees up sooner costs it no more than
the wait plus the reload; one that stays full costs it at most twice what knowing the
future would have, and no step duration is predicted.

Where it may go: another replica whose free GPU room holds it now, with no held request
of a CPU-queue program of its own (those come first there), and not the replica a
request past the bound waits for; the most free room first. The yields run at the start
of the round, before MORI's promotions: a CPU-queue program ranks above every cacheless
one, so it takes free room before them as it would at home. Every other rule is MORI's.
With one replica it is MORI.

The rates are estimates: the recompute rate is one number for every context (the
simulator gives its cost model's rate for a 32,768-token context in the preset's
chunks; elsewhere ``policy.DEFAULT_RECOMPUTE_TOK_S``; ``Policy.recompute_s``), while a real prefill slows as the
context grows.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.policies.mori import IdlenessAt, MoriPolicy
from mori.core.program import Program
from mori.core.types import Tier


class MoriYieldPolicy(MoriPolicy):
    name = "mori-yield"
    description = ("MORI, a CPU-queue program recomputed on a replica with room once it "
                   "has waited as long as that costs beyond a reload")

    def yield_after_s(self, p: Program) -> float:
        """How long ``p``'s request waits at home before it may move."""
        return max(0.0, self.recompute_s(p) - self.reload_s(p))

    def _rebalance(self, now: float, out: list[Decision], idleness: IdlenessAt) -> None:
        cap = self.cluster.gpu_bytes
        gpus = self.placement.gpu
        if cap is None or len(gpus) < 2:
            return
        held = [p for p in self.held_since(now) if p.tier is Tier.CPU]
        if not held:
            return
        homes = {p.replica for p in held}
        pid, aged = self.book.aged_wait
        if pid not in self._ready:
            aged = -1  # that request has been served (or ended)
        acting = self.book.sums.acting
        for c in held:
            home = c.replica
            assert home is not None
            if (c.kv_bytes > cap or now - c.ready_at < self.yield_after_s(c)
                    or cap - gpus[home].used + acting[home] >= c.kv_bytes):
                continue  # too young, or it can get in at home (free or made) this round
            best: int | None = None
            for r, gq in enumerate(gpus):
                if (r != home and r not in homes and r != aged and gq.fits(c.kv_bytes)
                        and (best is None or gq.free() > gpus[best].free())):
                    best = r
            if best is None:
                continue
            self._demote_to(c, Tier.NONE, None, out)
            self._promote(c, best, out)
            self._forward(c, now, out)
