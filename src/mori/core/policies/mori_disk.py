"""The disk tier under MORI's CPU tier: who is kept on a replica's disk instead of dropped.

MORI ranks and fills GPU, then CPU, then disk; the rest is dropped. A program that would
leave the faster tiers for no tier (pushed out of a full CPU tier, demoted from a GPU
with no room to park, or a CPU queue over capacity) goes to its replica's disk queue
instead, when:

- the replica has a disk tier large enough for it;
- writing it pays: a reload from disk (``Policy.disk_reload_s``: the policy's estimate of
  the read) is cheaper than a recompute of its context (``Policy.recompute_s``); a short
  context recomputes faster than a disk read's latency plus transfer, and is dropped;
- there is room, or room can be made by pushing out of the disk queue programs more idle
  than it, the most idle first (the disk tier holds the next-best ranked after the CPU
  tier, as the CPU tier holds the next after the GPU). A program on disk whose request is
  held is never pushed out for another: it is about to return, and would recompute.

A program on disk goes back to its own replica, as a CPU-queue program does (affinity:
its KV is there), and reads its KV back from the disk; it is promoted with the
CPU-queue programs, after them (its level is a returning program's: a read from disk
costs more than a reload from DRAM), before the programs in Uncached. Should a part of the policy place it on another replica, its
disk copy is dropped first and it recomputes there. A disk queue over capacity (a held
program's context grew) pushes out its most idle programs.

``DiskTier`` is a part of ``MoriPolicy`` (its ``disk`` field, None without a disk tier);
it changes nothing but through the moves it is handed.
"""

from __future__ import annotations

from collections.abc import Callable

from mori.core.decisions import Decision
from mori.core.ledger import Placement
from mori.core.policies.mori_round import IdlenessAt, Round
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["DiskTier"]

Demote = Callable[[Program, Tier, "int | None", list[Decision]], None]


class DiskTier:
    """Each replica's disk queue (see the module docstring).

    ``demote`` is the policy's move off a tier to the tier named (``Moves.demote_to``);
    ``disk_reload_s`` and ``recompute_s`` its estimates.
    """

    def __init__(self, placement: Placement, programs: dict[str, Program],
                 disk_reload_s: Callable[[Program], float],
                 recompute_s: Callable[[Program], float], demote: Demote) -> None:
        self.placement = placement
        self.programs = programs
        self.disk_reload_s = disk_reload_s
        self.recompute_s = recompute_s
        self.demote = demote

    def pays(self, p: Program) -> bool:
        """Whether keeping ``p`` on disk pays: its reload from disk is estimated cheaper
        than its recompute."""
        return self.disk_reload_s(p) < self.recompute_s(p)

    def victims(self, p: Program, replica: int, idleness: IdlenessAt) -> list[Program] | None:
        """The programs pushed off ``replica``'s disk to make room for ``p`` (most idle
        first, each more idle than ``p`` and not held), or None where ``p`` does not go
        to disk
        (no tier, too large, it does not pay, or not enough room can be made)."""
        dq = self.placement.disk[replica]
        if not dq.capacity or p.kv_bytes > dq.capacity or not self.pays(p):
            return None
        need = p.kv_bytes - dq.free()
        if need <= 0:
            return []
        mine = idleness(p)
        out: list[Program] = []
        for q in sorted((self.programs[pid] for pid in dq.members), key=idleness.desc):
            if idleness(q) <= mine:
                break
            if q.ready:
                continue  # its request is held: it returns soon (module docstring)
            out.append(q)
            need -= q.kv_bytes
            if need <= 0:
                return out
        return None

    def lands(self, p: Program, idleness: IdlenessAt) -> bool:
        """Whether ``p``, leaving its tier for none now, would be kept on its replica's
        disk."""
        return p.replica is not None and self.victims(p, p.replica, idleness) is not None

    def take(self, p: Program, rnd: Round) -> bool:
        """Move ``p`` (leaving a GPU or CPU tier for none) to its replica's disk if it
        goes there (pushing out who must leave); False if it does not."""
        r = p.replica
        if r is None or p.tier not in (Tier.GPU, Tier.CPU):
            return False
        victims = self.victims(p, r, rnd.idleness)
        if victims is None:
            return False
        for q in victims:
            self.demote(q, Tier.NONE, None, rnd.out)
        self.demote(p, Tier.DISK, r, rnd.out)
        return True

    def fix_overflow(self, grown: set[tuple[Tier, int]], rnd: Round) -> None:
        """Bring each disk queue over capacity back to it (a program on disk grew when its
        request arrived): its most idle programs go to no tier."""
        for t, r in sorted(grown):
            if t is not Tier.DISK:
                continue
            dq = self.placement.disk[r]
            if not dq.over():
                continue
            for q in sorted((self.programs[pid] for pid in dq.members),
                            key=rnd.idleness.desc):
                if not dq.over():
                    break
                self.demote(q, Tier.NONE, None, rnd.out)
