"""The ThunderAgent baselines, as the MORI paper describes them (docs/system.md, "The paper's evaluation").

ThunderAgent is program-aware: it pins a program's KV on the GPU across tool calls and
admits programs while they fit. When the active programs' KV is over capacity (their
contexts grew) it pauses programs, the smallest-context Acting ones first (cheapest to
recompute), dropping their KV: there is no CPU queue in the scheduler. Paused and new
programs with a held request are resumed when memory allows, the largest first; with
several replicas only GPU residency counts as affinity: a paused program is cacheless
and goes to the least-loaded replica (most free GPU KV) that holds it, wherever its KV
may survive in an engine's CPU pool (the churn MORI removes). It never pauses a program
to make room for another, and never looks at idleness. (This follows the MORI paper's
description and the port of ThunderAgent's scheduler in NVIDIA Dynamo: pause Acting
programs under memory pressure, resume when utilisation drops.)

``thunderagent+offload`` is the same scheduler in front of an engine with a CPU KV tier
managed by plain LRU (HiCache), not coordinated with the scheduler: a paused program's
KV may survive in the engine's CPU pool and be reloaded instead of recomputed.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.policy import EngineProfile, Policy
from mori.core.program import Program
from mori.core.types import Status, Tier


def _small_first(p: Program) -> tuple[int, int]:
    return (p.kv_bytes, p.ready_seq)


class ThunderAgentPolicy(Policy):
    name = "thunderagent"
    description = "ThunderAgent: program-aware pinning, smallest-context pause, no offload"
    engine_profile = EngineProfile(cpu_tier=False, typed_eviction=False)

    def _decide(self, now: float, out: list[Decision]) -> None:
        pl = self.placement
        for gq in pl.gpu:
            if gq.over():
                members = [self.programs[pid] for pid in gq.members]
                order = sorted((p for p in members if p.status is Status.ACTING),
                               key=_small_first)
                order += sorted((p for p in members if p.status is Status.GATED),
                                key=_small_first)
                for p in order:
                    if not gq.over():
                        break
                    self._demote_to(p, Tier.NONE, None, out)
        for p in sorted((q for q in self._ready.values() if q.tier is Tier.GPU),
                        key=lambda q: q.ready_seq):
            self._forward(p, now, out)
        cands = sorted((p for p in self._ready.values() if p.tier is not Tier.GPU),
                       key=lambda p: (-p.kv_bytes, p.ready_seq))
        cap = self.cluster.gpu_bytes
        gpus = pl.gpu
        # the least-loaded replica (most free GPU KV, the lowest index on a tie), found
        # again only after a placement: a candidate fits somewhere iff it fits there
        best: int | None = None
        for c in cands:  # largest first, onto the least-loaded replica that holds it
            if cap is not None and c.kv_bytes > cap:
                continue
            if best is None:
                best = max(range(len(gpus)), key=lambda r: (gpus[r].free(), -r))
            if gpus[best].free() >= c.kv_bytes:
                self._promote(c, best, out)
                self._forward(c, now, out)
                best = None
            # a program that does not fit stays paused until memory frees up: programs
            # end, or active ones grow past capacity and the smallest Acting is paused


class ThunderAgentOffloadPolicy(ThunderAgentPolicy):
    name = "thunderagent+offload"
    description = "ThunderAgent with an uncoordinated LRU CPU tier in the engine (TA+O)"
    engine_profile = EngineProfile(cpu_tier=True, typed_eviction=False)
