"""SMG: the SGLang Model Gateway baseline (docs/system.md, "The paper's evaluation"), and
``lru-offload``: the same with the engine's own CPU tier (what most users run today).

No program awareness: every request is forwarded at once and the engine's own plain
LRU decides whose KV survives. At one replica that is plain forwarding; with several
a program goes back to the replica it last ran on (its prefix is cached there) unless
that replica carries more than ``imbalance`` times the lightest one's programs, in
which case it goes to the lightest (an approximation of SGLang's cache-aware router:
longest prefix match unless the load imbalance passes a threshold).
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.ledger import ClusterSpec
from mori.core.policy import EngineProfile, Policy
from mori.core.types import Tier


class SMGPolicy(Policy):
    name = "smg"
    description = "SGLang Model Gateway: forward everything, engine LRU decides"
    engine_profile = EngineProfile(cpu_tier=False, typed_eviction=False)
    imbalance = 2.0

    @property
    def tick_interval(self) -> float | None:
        return None

    def _ledger_spec(self, cluster: ClusterSpec) -> ClusterSpec:
        return ClusterSpec(cluster.replicas, None, 0)  # the engine manages memory

    def _decide(self, now: float, out: list[Decision]) -> None:
        down = self.placement.down
        if len(down) == len(self.placement.gpu):
            return  # every replica is down: the requests wait
        # a replica that is down takes nothing (it counts as infinitely loaded)
        loads = [float("inf") if r in down else float(len(q.members))
                 for r, q in enumerate(self.placement.gpu)]
        for p in sorted(self._ready.values(), key=lambda q: q.ready_seq):
            lightest = loads.index(min(loads))  # the fewest programs, lowest index
            r = lightest
            if p.replica is not None and loads[p.replica] <= self.imbalance * max(
                    1, loads[lightest]):
                r = p.replica  # its prefix is cached there
            if p.tier is not Tier.GPU or p.replica != r:
                if p.replica is not None:
                    loads[p.replica] -= 1
                self._promote(p, r, out)
                loads[r] += 1
            self._forward(p, now, out)


class LRUOffloadPolicy(SMGPolicy):
    """``lru-offload``: what users run today without a program-aware gateway: every
    request forwarded at once (routed as ``smg``), the engine's own host tier written
    through and evicted LRU, as vLLM's ``OffloadingConnector`` or LMCache keeps it. An
    evicted GPU page is still in host memory (its copy was written as it was computed)
    and is reloaded, not recomputed, while the host tier holds it."""

    name = "lru-offload"
    description = "forward everything; the engine's write-through CPU tier, LRU (vLLM offloading)"
    engine_profile = EngineProfile(cpu_tier=True, typed_eviction=False)
