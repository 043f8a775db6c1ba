"""What the engines still hold at start: each program's KV as the replicas report it,
read once by a restarted gateway (``Controller.restore``) to give each program its place
back.

Each replica whose engine reports residency (``Capability.RESIDENCY``: ``/mori/v1/
residency`` and the like) is asked once. A program the engine says was released before
the restart is not live and is skipped. A program found on several replicas goes to the
one holding most of it on a GPU, then on a CPU (``Found.rank``). An engine that cannot
say is logged and skipped: its programs start afresh.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mori.core.types import Capability, Tier
from mori.gateway.replicas import Replicas

log = logging.getLogger("mori.gateway")


@dataclass(frozen=True, slots=True)
class Found:
    """Where a program's KV was found: ``tokens`` on ``replica``'s ``tier``. ``rank``
    orders the places of one program (any GPU place above any CPU one, then by tokens)."""

    rank: int
    tokens: int
    replica: int
    tier: Tier


async def read_residency(replicas: Replicas) -> dict[str, Found]:
    """The live programs the engines hold, each at its best place (``Found.rank``), the
    best placed first."""
    found: dict[str, Found] = {}
    for r in replicas.all:
        if not r.adapter.supports(Capability.RESIDENCY):
            continue
        try:
            res = await r.adapter.residency()
        except Exception as e:  # an engine that cannot say: nothing to restore there
            log.warning("replica %d: residency unread at start (%s); its programs "
                        "start afresh", r.index, e)
            continue
        for tier, held in ((Tier.GPU, res.gpu_tokens), (Tier.CPU, res.cpu_tokens)):
            for pid, tokens in held.items():
                if pid in res.ended:  # released before the restart: not live
                    continue
                rank = (2 if tier is Tier.GPU else 1) * (1 << 40) + tokens
                if tokens > 0 and (pid not in found or found[pid].rank < rank):
                    found[pid] = Found(rank, tokens, r.index, tier)
    return dict(sorted(found.items(), key=lambda kv: -kv[1].rank))
