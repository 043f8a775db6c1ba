"""MORI: rank by idleness, fill GPU then CPU exactly to capacity (docs/system.md, "Placement: rank, then fill each tier to capacity").

Every rule of section 4, and where a detail is ours:

- Sticky placement: nothing moves unless a tier is over capacity or a ready program
  needs room; the control loop runs on every tick and on every event.
- GPU over capacity (contexts grew): demote Acting programs before held (not yet
  forwarded) ones, highest idleness first. Reasoning programs never grow in the ledger (it
  accounts a step's output when the step finishes), so they are never needed here.
- A demoted program goes to its replica's CPU queue if it fits; if not, CPU programs
  more idle than it are pushed to Waiting to make room (the CPU tier holds the next-best
  ranked); failing that it goes to Waiting itself. CPU over capacity: highest idleness to
  Waiting first.
- Promotion order: (0) CPU-queue programs with a held request, (1) Waiting programs that
  are returning, (2) new programs, smallest context first; lowest idleness first within a
  level; then arrival order.
- A candidate that fits is promoted and forwarded at once. A CPU-queue program goes back
  to its own replica (affinity: it reloads locally). Cacheless (Waiting) programs are
  admitted in priority order while the replicas' free space together holds them, and
  placed the largest first, each onto the replica with the most free room, as long as
  that places all of them (memory does not bind); else by Best-Fit-Decreasing, each onto
  the replica where it fits most tightly. Ours, not the paper's, which packs by
  Best-Fit-Decreasing always: that ran everything on one replica while the others sat
  idle at low load, and overfilled the fullest replica near capacity
  (``mori_placement``; ``mori-pack`` keeps the paper's rule).
- Proactive demotion: for the first candidate that does not fit, Acting programs on the
  GPU are demoted, highest idleness first (a ready program outranks an idle one: ours, see
  ``mori_ranking``). If that is not enough but Reasoning programs would make up the rest,
  the Acting ones are demoted now and the replica's free space is reserved for the
  candidate (later candidates may only use space beyond the reservation); the Reasoning
  ones are demoted lazily: when their step ends, a later round finds them Acting and
  demotes them then. Otherwise nobody is demoted and it waits. With several replicas,
  room is made (ours: the paper does not say where) on a replica whose CPU tier can take
  what is demoted, then where the fewest must leave, then where the first program to
  leave is the most idle (``mori_room._room_plan``): the lowest index among equals
  alone sent every newcomer to replica 0 once all GPU tiers were full, and pushed
  programs from its full CPU tier to no tier while replica 1's stayed empty.
- Bounded waiting (ours, not the paper's, which lets a request wait for ever): before
  the promotions above, requests held ``max_wait_s`` or longer are served oldest first
  (``mori_aged``), Acting programs demoted for them; one that must wait for running
  steps to end has its replica's free space reserved for the round.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.policies.mori_book import IdlenessAt
from mori.core.policies.mori_round import MoriIndexedRound
from mori.core.policy import EngineProfile
from mori.core.program import Program
from mori.core.types import Tier

__all__ = ["MoriPolicy", "IdlenessAt"]

class MoriPolicy(MoriIndexedRound):
    name = "mori"
    description = "MORI: idleness-ranked GPU/CPU/Waiting placement with typed offloading"
    engine_profile = EngineProfile(cpu_tier=True, typed_eviction=True)
    uses_cpu_queue = True
    rebalances = False
    """Whether ``_rebalance`` moves programs (a variant that overrides it says True)."""

    def _rebalance(self, now: float, out: list[Decision], idleness: IdlenessAt) -> None:
        """Moves made on every decision round regardless of demand (none for MORI)."""

    # -- the decision round ------------------------------------------------------------
    def _decide(self, now: float, out: list[Decision]) -> None:
        if not self._ready and not self.book.grown and not self.rebalances:
            # no request held and no tier grew: no rule below has anything to do (the
            # most common round in a gateway, after each step's end); the candidate
            # index is brought up to date as the full round would
            if self.book.incremental:
                self.book.flush()
            return
        idleness = IdlenessAt(now)
        self._rebalance(now, out, idleness)
        self._fix_overflow(out, idleness)
        held_for = self._serve_aged(now, out, idleness) if self.config.max_wait_s else None
        if self._ready_gpu:
            for p in self.ready_on_gpu():
                self._forward(p, now, out)
        if self.book.incremental:
            self._promote_indexed(now, out, idleness, held_for)
        else:
            self._promote_ready(now, out, idleness, held_for)

    def _fix_overflow(self, out: list[Decision], idleness: IdlenessAt) -> None:
        # only a queue where a program grew since the last round can be over capacity
        if not self.book.grown:
            return
        grown: list[int] = []
        grown_cpu: list[int] = []
        for t, r in self.book.grown:
            if t is Tier.GPU:
                grown.append(r)
            elif t is Tier.CPU:
                grown_cpu.append(r)
        grown.sort()
        grown_cpu.sort()
        self.book.grown.clear()
        pl = self.placement
        for r in grown:
            gq = pl.gpu[r]
            if gq.over():
                order = (self._overflow_order(r, idleness) if self.book.incremental
                         else self._overflow_order_scan(r, idleness))
                for p in order:
                    if not gq.over():
                        break
                    self._offload(p, r, out, idleness)
                assert not gq.over(), "reasoning programs alone exceed the GPU tier"
        for r in grown_cpu:
            cq = pl.cpu[r]
            if cq.over():
                for p in sorted((self.programs[pid] for pid in cq.members), key=idleness.desc):
                    if not cq.over():
                        break
                    self._demote_to(p, Tier.NONE, None, out)

    def _promote_ready(self, now: float, out: list[Decision], idleness: IdlenessAt,
                       held_for: int | None = None) -> None:
        pl = self.placement
        cap = self.cluster.gpu_bytes
        cands = [p for p in self._ready.values() if p.tier is not Tier.GPU]
        if not cands:
            return

        def priority(p: Program) -> tuple[int, int, float, int]:
            level = 0 if p.tier is Tier.CPU else 1 if p.returning else 2
            return (level, p.tokens if level == 2 else 0, idleness(p), p.ready_seq)

        cands.sort(key=priority)
        gpus = pl.gpu
        reserve = [0] * len(gpus)
        if held_for is not None:  # a request past the bound waits for it (_serve_aged)
            reserve[held_for] = int(gpus[held_for].free())
        blocked = False
        # the most room any replica has beyond its reservation, or None when a move may
        # have changed it: once a candidate has been blocked, a cacheless one larger than
        # this fits nowhere and is passed over without a look at each replica
        most: float | None = None

        def fits_nowhere(c: Program) -> bool:
            return cap is not None and c.kv_bytes > cap  # refused up front by the simulator

        def place(c: Program, r: int) -> None:
            nonlocal most
            self._promote(c, r, out)
            self._forward(c, now, out)
            most = None

        def place_or_make_room(c: Program) -> None:
            """Into free space if it fits; else the first such program may make room."""
            nonlocal blocked, most
            if blocked and c.tier is Tier.NONE:
                if most is None:
                    most = max(gq.free() - reserve[r] for r, gq in enumerate(gpus))
                if c.kv_bytes > most:
                    return
            r = self.choice.best_fit(c, reserve)
            if r is not None:
                place(c, r)
            elif not blocked:
                blocked = True
                self._make_room(c, now, out, idleness, reserve)
                most = None

        # (0) CPU-queue programs: their own replica (affinity), in priority order
        for c in (c for c in cands if c.tier is Tier.CPU and not fits_nowhere(c)):
            place_or_make_room(c)
        # (1, 2) cacheless programs: *who* is admitted follows the priority order, as
        # long as the free space of all replicas together holds them; *where*: the
        # largest first, each onto the replica with the most room if that places them
        # all (choice.spread), else onto the replica it fits tightest (Best-Fit-Decreasing)
        waiting = [c for c in cands if c.tier is Tier.NONE and not fits_nowhere(c)]
        room = sum(max(0.0, gq.free() - reserve[r]) for r, gq in enumerate(gpus))
        batch: list[Program] = []
        for c in waiting:
            if c.kv_bytes > room:
                break
            batch.append(c)
            room -= c.kv_bytes
        order = sorted(batch, key=lambda p: (-p.kv_bytes, p.ready_seq))
        spread = self.choice.spread(order, reserve)
        placed: set[str] = set()
        for c in order:
            r = spread[c.program_id] if spread is not None else self.choice.best_fit(c, reserve)
            if r is not None:
                place(c, r)
                placed.add(c.program_id)
        # what is left: backfill into free space; the first that does not fit (if no
        # CPU-queue program did) may make room
        for c in waiting:
            if c.program_id not in placed:
                place_or_make_room(c)
