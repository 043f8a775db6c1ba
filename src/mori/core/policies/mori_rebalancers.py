"""Moves a variant of MORI makes on every decision round, whether or not a request
needs room: ``MoriPolicy``'s ``rebalancer`` part (``mori.Rebalancer``). MORI has none.

- ``OffloadIdle`` (``mori-binary``): each Acting GPU program idle by the threshold goes
  to its CPU tier, or to none.
- ``YieldAffinity`` (``mori-yield``, ours, not the paper's): a CPU-queue program's
  affinity may yield.

MORI sends a CPU-queue program back to its own replica, where its KV waits to be
reloaded, however long that replica stays full. When only running steps fill it (no
Acting program is left to demote: the program cannot get in this round whatever MORI
does) and another replica has room for it now, the program may instead drop its CPU
copy and be recomputed there. The cost model's estimates decide when, by the
ski-rental rule again: the program waits at home until it has waited as long as a
recompute costs beyond a reload (its context over ``recompute_tok_s``, less its KV over
``reload_gbps``); then it moves. A replica that frees up sooner costs it no more than
the wait plus the reload; one that stays full costs it at most twice what knowing the
future would have, and no step duration is predicted.

Where it may go: another replica whose free GPU room holds it now, with no held request
of a CPU-queue program of its own (those come first there), and not the replica a
request past the bound waits for; the most free room first. The yields run at the start
of the round, before MORI's promotions: a CPU-queue program ranks above every cacheless
one, so it takes free room before them as it would at home. Every other rule is MORI's.
With one replica it is MORI.

The rates are estimates: the recompute rate is one number for every context (the
simulator gives its cost model's rate for a 32,768-token context in the preset's
chunks; elsewhere ``policy.DEFAULT_RECOMPUTE_TOK_S``; ``Policy.recompute_s``), while a real prefill slows as the
context grows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from mori.core.ledger import ClusterSpec, Placement
from mori.core.policies.mori_aged import WaitBound
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_ranking import Threshold
from mori.core.policies.mori_room import RoomMaker
from mori.core.policies.mori_round import Round
from mori.core.policies.moves import Moves
from mori.core.program import Program
from mori.core.types import Status, Tier

__all__ = ["OffloadIdle", "YieldAffinity"]


class OffloadIdle:
    """``mori-binary``'s moves on every round: each Acting GPU program idle by the
    threshold goes to its CPU tier (or to none), whether or not the GPU needs the room."""

    def __init__(self, threshold: Threshold, placement: Placement,
                 programs: dict[str, Program], room: RoomMaker) -> None:
        self.threshold = threshold
        self.placement = placement
        self.programs = programs
        self.room = room

    def rebalance(self, rnd: Round) -> None:
        for r, gq in enumerate(self.placement.gpu):
            for pid in list(gq.members):
                p = self.programs[pid]
                if p.status is Status.ACTING and self.threshold.idle(rnd.idleness(p)):
                    self.room.offload(p, r, rnd)


class YieldAffinity:
    """``mori-yield``'s moves on every round (see the module docstring). ``ready``: the
    policy's held requests (shared); ``reload_s`` and ``recompute_s``: its estimates
    (``Policy.reload_s``, ``Policy.recompute_s``); ``aged``: its bound on waiting (None
    without one), whose waiting request's replica no program yields to."""

    def __init__(self, cluster: ClusterSpec, placement: Placement, book: MoriBook,
                 ready: dict[str, Program], held_since: Callable[[float], Iterator[Program]],
                 reload_s: Callable[[Program], float], recompute_s: Callable[[Program], float],
                 moves: Moves, aged: WaitBound | None) -> None:
        self.cluster = cluster
        self.placement = placement
        self.book = book
        self.ready = ready
        self.aged = aged
        self.held_since = held_since
        self.reload_s = reload_s
        self.recompute_s = recompute_s
        self.moves = moves

    def after_s(self, p: Program) -> float:
        """How long ``p``'s request waits at home before it may move."""
        return max(0.0, self.recompute_s(p) - self.reload_s(p))

    def rebalance(self, rnd: Round) -> None:
        now = rnd.now
        cap = self.cluster.gpu_bytes
        gpus = self.placement.gpu
        if cap is None or len(gpus) < 2:
            return
        held = [p for p in self.held_since(now) if p.tier is Tier.CPU]
        if not held:
            return
        homes = {p.replica for p in held}
        # the replica a request past the bound waits for (-1: none, or served since)
        aged = self.aged.waits_for(self.ready.__contains__) if self.aged is not None else -1
        acting = self.book.sums.acting
        for c in held:
            home = c.replica
            assert home is not None
            if (c.kv_bytes > cap or now - c.ready_at < self.after_s(c)
                    or cap - gpus[home].used + acting[home] >= c.kv_bytes):
                continue  # too young, or it can get in at home (free or made) this round
            best: int | None = None
            for r, gq in enumerate(gpus):
                if (r != home and r not in homes and r != aged and gq.fits(c.kv_bytes)
                        and (best is None or gq.free() > gpus[best].free())):
                    best = r
            if best is None:
                continue
            self.moves.drop(c, rnd)
            self.moves.place(c, best, rnd)
