"""MORI's variants: ``MoriPolicy`` built with other parts, one class per registered name.

Each is a constructor only: it hands ``MoriPolicy`` a ranking (``mori_ranking``), a
config, or a rebalancer (``mori_rebalancers``), or sets its ``spreads``. None overrides
a method.

``mori-paper`` is MORI by the paper's rules: any Acting program may leave the GPU for a
ready one, at once (``Ranking``). The default ``mori`` weighs what the move costs
(``ReturnCost``). The ablations and the other variants below are of ``mori-paper``:
each changes one rule of the paper's.

Ablations (docs/system.md, "The workload" and "Idleness"):

- ``mori-binary``: a fixed busy/idle threshold on idleness instead of a ranking. A program
  is idle when idleness >= ``binary_threshold``; idle Acting programs are offloaded to the
  CPU tier on every round whether or not the GPU needs the room (label decides tier),
  any idle Acting program may be demoted for any ready one, and a program demoted to a
  full CPU tier goes to Uncached (no ranking to decide who deserves the CPU).
- ``mori-strict``: proactive demotion only of Acting programs *more idle than* the ready
  one (a literal reading of "a better-ranked program is ready"); it leaves the GPU idle
  while a ready program waits for a busy one's phase to change.
- ``mori-no-exclusion``: MORI with the scheduler's held time counted as acting time in
  the idleness window, to show the feedback loop the exclusion prevents.
- ``mori-pack``: the paper's placement of cacheless programs, Best-Fit-Decreasing
  always; MORI spreads them (the most room) while memory does not bind
  (``mori_placement``).

Ours, not the paper's:

- ``mori-ski``: MORI with a ski-rental guard on proactive demotion (``SkiRental``).
  MORI demotes an Acting program to make room for a ready one whatever it will cost to
  bring it back. When tool calls are short, the demoted program returns at once and its
  KV is reloaded over PCIe: on the shipped traces at 50 programs and more nearly every
  turn is a reload. The guard is the ski-rental rule: an Acting program may be displaced
  for a ready one only once it has been acting at least as long as its reload would take
  (its KV bytes over the reload bandwidth). A program that returns sooner than that
  never paid for a reload; one that stays away longer has already "rented" the GPU for
  as long as a reload costs, so moving it at most doubles the cost of the optimum, and
  no tool duration is predicted. Overflow (a program grew past the GPU tier) is fixed
  as in MORI, unguarded. Every other rule is MORI's.

  The bandwidth is ``PolicyConfig.reload_gbps``: the simulator gives its modelled link
  (``--reload-gbps`` or the preset's, divided by ``--engine-slowdown``); elsewhere it defaults
  to ``DEFAULT_RELOAD_GBPS`` (``Policy.reload_s``).
- ``mori-yield``: MORI whose affinity may yield (``YieldAffinity``, in
  ``mori_rebalancers``, says when and where).
"""

from __future__ import annotations

import dataclasses

from mori.core.ledger import ClusterSpec
from mori.core.policies.mori import MoriPolicy
from mori.core.policies.mori_ranking import MoreIdle, Ranking, SkiRental, Threshold
from mori.core.policies.mori_rebalancers import OffloadIdle, YieldAffinity
from mori.core.policy import PolicyConfig

__all__ = ["MoriBinaryPolicy", "MoriNoExclusionPolicy", "MoriStrictPolicy", "MoriPackPolicy",
           "MoriSkiPolicy", "MoriYieldPolicy"]


class MoriBinaryPolicy(MoriPolicy):
    name = "mori-binary"
    description = "ablation: fixed busy/idle threshold instead of ranking"

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        threshold = Threshold((config or PolicyConfig()).binary_threshold)
        super().__init__(cluster, kv_bytes_per_token, config, ranking=threshold)
        self.rebalancer = OffloadIdle(threshold, self.placement, self.programs, self.room)


class MoriNoExclusionPolicy(MoriPolicy):
    name = "mori-no-exclusion"
    description = "ablation: held (scheduler-imposed) time counted in idleness"

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        base = config or PolicyConfig()
        super().__init__(cluster, kv_bytes_per_token,
                         dataclasses.replace(base, exclude_held=False), ranking=Ranking())


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

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config, ranking=Ranking())


class MoriSkiPolicy(MoriPolicy):
    name = "mori-ski"
    description = "MORI, an Acting program displaced only after acting as long as its reload"

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        # reload_s reads the policy's config when called, after it is set
        super().__init__(cluster, kv_bytes_per_token, config, ranking=SkiRental(self.reload_s))


class MoriYieldPolicy(MoriPolicy):
    name = "mori-yield"
    description = ("MORI, a CPU-queue program recomputed on a replica with room once it "
                   "has waited as long as that costs beyond a reload")

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config, ranking=Ranking())
        self.rebalancer = YieldAffinity(self.cluster, self.placement, self.book, self._ready,
                                        self.held_since, self.reload_s, self.recompute_s,
                                        self.moves, self.aged)


class MoriPaperPolicy(MoriPolicy):
    name = "mori-paper"
    description = "MORI by the paper's rules: any Acting program may leave for a ready one, at once"

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config, ranking=Ranking())
