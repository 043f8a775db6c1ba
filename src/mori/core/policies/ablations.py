"""Ablations of MORI (docs/system.md, "The workload" and "Idleness").

- ``mori-binary``: a fixed busy/idle threshold on idleness instead of a ranking. A program
  is idle when idleness >= ``binary_threshold``; idle Acting programs are offloaded to the
  CPU tier on every round whether or not the GPU needs the room (label decides tier),
  any idle Acting program may be demoted for any ready one, and a program demoted to a
  full CPU tier goes to Waiting (no ranking to decide who deserves the CPU).
- ``mori-strict``: proactive demotion only of Acting programs *more idle than* the ready
  one (a literal reading of "a better-ranked program is ready"); it leaves the GPU idle
  while a ready program waits for a busy one's phase to change.
- ``mori-no-exclusion``: MORI with the scheduler's gated time counted as acting time in
  the idleness window, to show the feedback loop the exclusion prevents.
- ``mori-pack``: the paper's placement of cacheless programs, Best-Fit-Decreasing
  always; MORI spreads them (the most room) while memory does not bind
  (``mori_placement``).
"""

from __future__ import annotations

import dataclasses

from mori.core.decisions import Decision
from mori.core.ledger import ClusterSpec
from mori.core.policies.mori import IdlenessAt, MoriPolicy
from mori.core.policies.mori_ranking import MoreIdle, Threshold
from mori.core.policy import PolicyConfig
from mori.core.program import Program
from mori.core.types import Status, Tier


class MoriBinaryPolicy(MoriPolicy):
    name = "mori-binary"
    description = "ablation: fixed busy/idle threshold instead of ranking"
    rebalances = True

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        threshold = Threshold((config or PolicyConfig()).binary_threshold)
        super().__init__(cluster, kv_bytes_per_token, config, ranking=threshold)
        self.threshold = threshold

    def _rebalance(self, now: float, out: list[Decision], idleness: IdlenessAt) -> None:
        for r, gq in enumerate(self.placement.gpu):
            for pid in list(gq.members):
                p = self.programs[pid]
                if p.status is Status.ACTING and self.threshold.idle(idleness(p)):
                    self._offload(p, r, out, idleness)

    def _offload(self, p: Program, replica: int, out: list[Decision], idleness: IdlenessAt,
                 keep: Program | None = None) -> None:
        cq = self.placement.cpu[replica]
        to = Tier.CPU if cq.capacity and cq.fits(p.kv_bytes) else Tier.NONE
        self._demote_to(p, to, replica, out)


class MoriNoExclusionPolicy(MoriPolicy):
    name = "mori-no-exclusion"
    description = "ablation: gated (scheduler-imposed) time counted in idleness"

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        base = config or PolicyConfig()
        super().__init__(cluster, kv_bytes_per_token,
                         dataclasses.replace(base, exclude_gated=False))


class MoriStrictPolicy(MoriPolicy):
    name = "mori-strict"
    description = "ablation: demote only programs more idle than the ready one"

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config, ranking=MoreIdle())


class MoriPackPolicy(MoriPolicy):
    name = "mori-pack"
    description = "ablation: the paper's placement, cacheless programs always packed"
    spreads = False
