"""``mori-ski``: MORI with a ski-rental guard on proactive demotion (ours, not the paper's).

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
(``--reload-gbps`` or the preset's, divided by ``--time-scale``); elsewhere it defaults
to ``DEFAULT_RELOAD_GBPS`` (``Policy.reload_s``).
"""

from __future__ import annotations

from mori.core.ledger import ClusterSpec
from mori.core.policies.mori import MoriPolicy
from mori.core.policies.mori_ranking import SkiRental
from mori.core.policy import PolicyConfig


class MoriSkiPolicy(MoriPolicy):
    name = "mori-ski"
    description = "MORI, an Acting program displaced only after acting as long as its reload"

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config)
        self.ranking = SkiRental(self.reload_s)  # reload_s reads the config just set
