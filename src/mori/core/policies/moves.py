"""``Moves``: the three moves a part of a policy may make, and nothing else.

The parts of ``MoriPolicy`` (room making, the bound on waiting, the round) decide; the
policy owns the program table and the ledger. A part changes them only through these
moves, handed to it by the policy, so every change passes the policy's hooks that keep
its book exact (``mori_book``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mori.core.decisions import Decision
from mori.core.program import Program
from mori.core.types import Tier


@dataclass(frozen=True, slots=True)
class Moves:
    """The policy's moves, bound to it (``Policy._promote``, ``_forward``, ``_demote_to``)."""

    promote: Callable[[Program, int, list[Decision]], None]
    """Move a program onto a replica's GPU tier (from its CPU tier, or from none)."""
    forward: Callable[[Program, float, list[Decision]], None]
    """Send a GPU-resident program's held request to its replica."""
    demote_to: Callable[[Program, Tier, int | None, list[Decision]], None]
    """Move a program off its tier: to a replica's CPU tier, or to none (dropped)."""

    def place(self, p: Program, replica: int, now: float, out: list[Decision]) -> None:
        """Promote ``p`` onto ``replica``'s GPU and forward its request at once."""
        self.promote(p, replica, out)
        self.forward(p, now, out)
