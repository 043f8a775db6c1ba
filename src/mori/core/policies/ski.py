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

from mori.core.policies.mori import MoriPolicy
from mori.core.program import Program


class MoriSkiPolicy(MoriPolicy):
    name = "mori-ski"
    description = "MORI, an Acting program displaced only after acting as long as its reload"

    def _displaceable(self, p: Program, now: float) -> bool:
        last = p.history[-1] if p.history else None
        if last is None or last.finished is None:
            return True
        return now - last.finished >= self.reload_s(p)
