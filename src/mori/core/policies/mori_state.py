"""``MoriState``: the policy table of ``Policy`` with MORI's book (``mori_book``) kept
up to date by the policy's hooks around every change of a program. The rules that use
the book are in ``mori.core.policies.mori``.
"""

from __future__ import annotations

from typing import ClassVar

from mori.core.decisions import Decision
from mori.core.ledger import ClusterSpec
from mori.core.policies.mori_book import IdlenessAt, MoriBook
from mori.core.policies.mori_placement import ReplicaChoice
from mori.core.policies.mori_ranking import Ranking
from mori.core.policy import Policy, PolicyConfig
from mori.core.program import Program

__all__ = ["IdlenessAt", "MoriState"]


class MoriState(Policy):
    """The program table of ``Policy`` plus MORI's book (``self.book``), its choice of
    replicas (``self.choice``, ``mori_placement``) and its ranking (``self.ranking``,
    ``mori_ranking``, handed in by a variant)."""

    spreads: ClassVar[bool] = True
    """Whether cacheless programs are spread while memory does not bind (else packed)."""

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None, ranking: Ranking | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config)
        self.ranking = ranking or Ranking()
        """Who may leave the GPU to make room for whom (``mori_ranking``)."""
        self.book = MoriBook(self.placement, self.programs, self._ready, self.cluster,
                             self.config)
        self.choice = ReplicaChoice(self.placement, self.book, self._spread_loads,
                                    spreads=self.spreads)

    def _spread_loads(self) -> tuple[int, ...] | None:
        return self.replica_loads if self.config.spread_by_load else None

    # -- the book kept up to date around every change of a program ----------------------
    def _forward(self, p: Program, now: float, out: list[Decision]) -> None:
        held = self.book.round_idleness
        if held is not None:
            # a candidate's idleness as the round ranked it (held), before its step starts
            key = self.book.index.key_of(p.program_id)
            if key is not None:
                held.hold(p, key[2])
        super()._forward(p, now, out)

    def _resize(self, p: Program, tokens: int) -> None:
        super()._resize(p, tokens)
        self.book.resized(p)

    def _gone(self, program_id: str, was: int | None) -> None:
        self.book.gone(program_id, was)

    def _unhook(self, p: Program) -> int | None:
        return self.book.unhook(p)

    def _hook(self, p: Program, was: int | None) -> None:
        self.book.hook(p, was)

    def _capacity_changed(self, replica: int) -> None:
        self.book.capacity_changed(replica)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.book.check()
