"""``Moves``: the moves a part of a policy may make, and nothing else.

The parts of ``MoriPolicy`` (room making, the bound on waiting, the promotions) decide;
the policy owns the program table and the ledger. A part changes them only through these
moves, handed to it by the policy, so every change passes the policy's hooks that keep
its book exact (``mori_book``). Each move takes the round it is made in (``mori_round``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mori.core.decisions import Decision
from mori.core.policies.mori_round import Round
from mori.core.program import Program
from mori.core.types import Tier


@dataclass(frozen=True, slots=True)
class Moves:
    """The policy's moves, bound to it (``MoriPolicy``)."""

    promote: Callable[[Program, int, list[Decision]], None]
    """Move a program onto a replica's GPU tier (from its CPU or disk tier, or none)."""
    forward: Callable[[Program, Round], None]
    """Send a GPU-resident program's held request to its replica."""
    demote_to: Callable[[Program, Tier, int | None, list[Decision]], None]
    """Move a program off its tier to the tier named: a replica's CPU or disk tier, or
    none (dropped), exactly as told."""
    drop: Callable[[Program, Round], None]
    """A program leaves the GPU or CPU tier for no faster tier: kept on its replica's
    disk where the disk tier takes it (``DiskTier.take``), else dropped."""

    def place(self, p: Program, replica: int, rnd: Round) -> None:
        """Promote ``p`` onto ``replica``'s GPU and forward its request at once."""
        self.promote(p, replica, rnd.out)
        self.forward(p, rnd)
