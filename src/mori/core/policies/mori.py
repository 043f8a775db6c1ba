"""MORI: rank by idleness, fill GPU then CPU exactly to capacity (docs/system.md, "Placement: rank, then fill each tier to capacity").

Every rule of section 4, and where a detail is ours:

- Sticky placement: nothing moves unless a tier is over capacity or a ready program
  needs room; the control loop runs on every tick and on every event.
- GPU over capacity (contexts grew): demote Acting programs before held (not yet
  forwarded) ones, highest idleness first. Reasoning programs never grow in the ledger (it
  accounts a step's output when the step finishes), so they are never needed here.
- A demoted program goes to its replica's CPU queue if it fits; if not, CPU programs
  more idle than it are pushed to Uncached to make room (the CPU tier holds the next-best
  ranked); failing that it goes to Uncached itself. CPU over capacity: highest idleness to
  Uncached first.
- Promotion order: (0) CPU-queue programs with a held request, (1) Uncached programs that
  are returning, (2) new programs, smallest context first; lowest idleness first within a
  level; then arrival order. Ours (the default ``mori``; the ablations keep the paper's):
  the Uncached programs, returning or new, all smallest context first
  (``mori_index.priority_smallest_first``): each costs a recompute of its whole context
  and takes that much GPU room, and on a full GPU the number running sets the throughput.
- A candidate that fits is promoted and forwarded at once. A CPU-queue program goes back
  to its own replica (affinity: it reloads locally). Cacheless (Uncached) programs are
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
  leave is the most idle (``RoomMaker.plan``, ``mori_room``): the lowest index among equals
  alone sent every newcomer to replica 0 once all GPU tiers were full, and pushed
  programs from its full CPU tier to no tier while replica 1's stayed empty.
- Room on every replica (ours, not the paper's): the promotions let only the first
  candidate that does not fit make room, which keeps the priority order on one replica
  but, with several, held a request whose own replica's Acting programs could make room
  at once behind another replica's candidate waiting for running steps to end. After
  the promotions, each replica where no room was made or reserved this round makes room
  for its own first parked candidate, if it can now (``RoomMaker.each_replica``; the
  ablations keep the paper's rule).
- A disk tier (ours; the paper names it future work): where a replica has one, a
  program that would go to no tier is kept on the replica's disk where that pays, and
  programs more idle than it are pushed off a full disk for it; a held program on disk
  goes back to its own replica, promoted after the CPU-queue programs and before those
  in Uncached (``mori_disk``).
- Work conservation (ours, not the paper's; ``PolicyConfig.fill_idle``): after the
  promotions, a replica with no step running takes the oldest held request that can go
  there, its Acting programs parking for it in free CPU room without waiting out the
  reload's price (``mori_idle_fill``; off by default): holding a request on an idle
  engine wastes it.
- A GPU tier sized to the engine (ours, not the paper's; ``PolicyConfig.gpu_overcommit``
  and ``gpu_overcommit_max``): the tier may be larger than the engine's pool, whose own
  eviction in MORI's label order then keeps what fits; fixed, or following the engine
  at each round (``mori_overcommit``: larger while requests are held on engines that
  keep up, smaller when the requests in flight overrun the pool).
- Bounded waiting (ours, not the paper's, which lets a request wait for ever): before
  the promotions above, requests held ``max_wait_s`` or longer are served oldest first
  (``mori_aged``), Acting programs demoted for them; one that must wait for running
  steps to end has its replica's free space reserved for the round.
"""

from __future__ import annotations

import math
from typing import ClassVar, Protocol

from mori.core.decisions import Decision
from mori.core.ledger import ClusterSpec
from mori.core.ordered import Key
from mori.core.policies.mori_aged import WaitBound
from mori.core.policies.mori_book import MoriBook
from mori.core.policies.mori_disk import DiskTier
from mori.core.policies.mori_idle_fill import IdleFill
from mori.core.policies.mori_index import AFFINE, priority, priority_smallest_first
from mori.core.policies.mori_overcommit import Overcommit
from mori.core.policies.mori_placement import ReplicaChoice
from mori.core.policies.mori_promote import IndexedPromotion
from mori.core.policies.mori_promote_scan import ScanPromotion
from mori.core.policies.mori_ranking import Ranking, ReturnCost
from mori.core.policies.mori_room import RoomMaker
from mori.core.policies.mori_round import IdlenessAt, Round
from mori.core.policies.moves import Moves
from mori.core.policy import EngineProfile, Policy, PolicyConfig
from mori.core.program import Program
from mori.core.types import Status, Tier

__all__ = ["MoriPolicy", "IdlenessAt", "Rebalancer", "Round"]


class Rebalancer(Protocol):
    """Moves a variant makes on every decision round, before MORI's rules, whether or
    not a request needs room (``mori-binary``'s offloading by label, ``mori-yield``'s
    yielding affinity). MORI itself has none."""

    def rebalance(self, rnd: Round) -> None: ...


class MoriPolicy(Policy):
    """MORI (see the module docstring): ``Policy``'s program table and ledger, and the
    parts that decide, each a field:

    - ``book`` (``mori_book``): the indexes kept up to date by the hooks below;
    - ``ranking`` (``mori_ranking``): who may leave the GPU for whom, handed in by a
      variant;
    - ``choice`` (``mori_placement``): which replica a program goes to;
    - ``room`` (``mori_room``): who leaves, and where room is made;
    - ``aged`` (``mori_aged``): the bound on waiting (None without one);
    - ``promotion``: the promotions, from the index (``mori_promote``), or by scanning
      every held request where the index cannot serve (``mori_promote_scan``);
    - ``rebalancer``: a variant's moves on every round (None for MORI);
    - ``disk`` (``mori_disk``): who is kept on a replica's disk tier (None without one);
    - ``idle_fill`` (``mori_idle_fill``): an idle replica takes a held request (None:
      off, or a variant's ranking).

    The parts change the table only through ``moves`` (``moves``), the policy's own
    moves, so the book stays exact. Each decision is one ``Round`` (``mori_round``),
    created in ``_decide`` and handed to every phase.
    """

    name = "mori"
    description = "MORI: idleness-ranked GPU/CPU/Uncached placement with typed offloading"
    engine_profile = EngineProfile(cpu_tier=True, typed_eviction=True)
    uses_cpu_queue = True
    uses_disk_queue = True
    spreads: ClassVar[bool] = True
    """Whether cacheless programs are spread while memory does not bind (else packed)."""

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None, ranking: Ranking | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config)
        own = ranking is None  # MORI's own rules; the ablations keep the paper's
        self.book = MoriBook(self.placement, self.programs, self._ready, self.cluster,
                             self.config,
                             priority_smallest_first if own else priority)
        self.disk = (DiskTier(self.placement, self.programs, self.disk_reload_s,
                              self.recompute_s, self._demote_to)
                     if self.cluster.disk_bytes else None)
        self.ranking = ranking or ReturnCost(
            self.placement, self.book, self.reload_s, self.recompute_s, self.disk,
            self.load if self.config.load_window_s else None, self.reload_engine_s)
        self.choice = ReplicaChoice(self.placement, self.book, self._spread_loads,
                                    spreads=self.spreads)
        self.moves = Moves(self._promote, self._forward_in, self._demote_to, self._drop)
        self.room = RoomMaker(self.placement, self.programs, self._ready_gpu, self.book,
                              self.choice, self.ranking, self.moves)
        self.aged = (WaitBound(self.config.max_wait_s, self.held_since, self.cluster,
                               self.placement, self.book, self.choice, self.room, self.moves)
                     if self.config.max_wait_s else None)
        self.promotion: IndexedPromotion | ScanPromotion = (
            IndexedPromotion(self.placement, self._ready_gpu, self.book, self.choice,
                             self.room, self.moves) if self.book.incremental
            else ScanPromotion(self.placement, self.cluster, self._ready, self.choice,
                               self.room, self.moves, self.book.priority))
        self.rebalancer: Rebalancer | None = None
        self.replica_room = own
        """Whether every replica makes room for its own first parked candidate
        (``RoomMaker.each_replica``): MORI's own rule, not the paper's ablations'."""
        self.idle_fill = (IdleFill(self.placement, self.book, self.load, self.held_since,
                                   self._foreign_load, self.room, self.moves,
                                   self.recompute_s)
                          if ranking is None and self.config.fill_idle else None)
        c = self.config
        self.overcommit = (
            Overcommit(self.placement, self.book, self.load, self.pool_gpu_bytes,
                       c.gpu_overcommit, max(c.gpu_overcommit, c.gpu_overcommit_max),
                       c.gpu_overcommit_period_s or self.load.window_s,
                       lambda: bool(self._ready))
            if (ranking is None and self.book.incremental and self.pool_gpu_bytes
                and c.gpu_overcommit_max > c.gpu_overcommit) else None)

    def _replica_heads(self, rnd: Round) -> list[tuple[int, Program]]:
        """Per replica, its first held candidate in priority order among the programs
        parked or kept on disk there, ascending by replica; only where that candidate
        fits the replica's free room beyond the round's reservation and its Acting
        programs' KV (``RoomMaker.each_replica`` needs no more: elsewhere no room can be
        made now)."""
        gpus, acting = self.placement.gpu, self.book.sums.acting
        heads: list[tuple[int, Program]] = []
        if self.book.incremental:
            idx = self.book.index
            for r in sorted(self.book.heads_fitting()):
                first = idx.cpu[r].first()
                if (first is not None
                        and gpus[r].free() - rnd.reserved(r) + acting[r] >= first[1]):
                    heads.append((r, first[2]))
            return heads
        best: dict[int, tuple[Key, Program]] = {}
        for p in self._ready.values():
            if p.tier in AFFINE and p.replica is not None:
                k = self.book.priority(p, rnd.idleness(p))
                if p.replica not in best or k < best[p.replica][0]:
                    best[p.replica] = (k, p)
        return [(r, p) for r, (_, p) in sorted(best.items())
                if gpus[r].free() - rnd.reserved(r) + acting[r] >= p.kv_bytes]

    def _foreign_load(self, replica: int) -> int:
        """Requests of other clients on ``replica`` as last told (0: none told)."""
        loads = self.foreign_loads
        return loads[replica] if loads is not None else 0

    def hold_reason(self, program_id: str, now: float) -> str | None:
        """Why a held request waits: on the replica where it would go soonest, how much
        room it needs beyond what is free, and when the Acting programs there may leave
        to make it (under ``ReturnCost``: once their drop, or their park, pays),
        or that the rest is held by running steps. It ignores the candidates ranked
        ahead of it, so it says when room can be made, not that this request gets it."""
        p = self.programs.get(program_id)
        if p is None or not p.ready:
            return None
        if p.tier is Tier.GPU:
            return "its KV is on a GPU: the request goes on at the next round"
        gpus = self.placement.gpu
        replicas = ([p.replica] if p.tier in AFFINE and p.replica is not None
                    else [r for r in range(len(gpus)) if r not in self.placement.down])
        idleness = IdlenessAt(now)
        best: tuple[float, str] | None = None
        for r in replicas:
            need = p.kv_bytes - gpus[r].free()
            if need <= 0:
                return f"replica {r} has room: it is placed at the next round"
            leave: list[tuple[float, Program]] = []
            for pid in gpus[r].members:
                q = self.programs[pid]
                if q.status is Status.ACTING:
                    ok = self.ranking.victim_ok(idleness(q), idleness(p))
                    leave.append((self._leaves_in(q, idleness) if ok else math.inf, q))
            leave.sort(key=lambda t: t[0])
            for wait, q in leave:
                if math.isinf(wait):
                    break  # the rest may never leave for it (the ranking forbids it)
                need -= q.kv_bytes
                if need <= 0:
                    short = (p.kv_bytes - gpus[r].free()) / self.kv_bytes_per_token
                    why = (f"replica {r} needs {short:,.0f} tokens of room more than it has "
                           f"free; its Acting programs make that room "
                           + ("now" if wait <= 0 else f"in {wait:.1f} s, when {q.program_id}'s "
                              f"leaving pays for its return"))
                    if best is None or wait < best[0]:
                        best = (wait, why)
                    break
        if best is not None:
            return best[1]
        return ("no replica's free room and Acting programs hold it: it waits for running "
                "steps to end")

    def _leaves_in(self, q: Program, idleness: IdlenessAt) -> float:
        """Seconds until the Acting program ``q`` may leave to make room (0: now)."""
        if self.ranking.displaceable(q, idleness):
            return 0.0
        if isinstance(self.ranking, ReturnCost):
            price = self.ranking.drop_s(q, idleness.now)
            if self.disk is not None and self.disk.lands(q, idleness):
                price = min(price, self.disk_reload_s(q))
            if self.ranking.parks(q, idleness):
                price = min(price, self.ranking.park_s(q, idleness.now))
            return max(0.0, price - self.ranking.away_s(q, idleness.now))
        return math.inf

    def return_cost(self, p: Program, to: Tier, replica: int, now: float) -> float:
        """``Policy.return_cost``; under ``ReturnCost`` a recompute counts for every
        program it delays on that replica, as ``ReturnCost.drop_s`` counts them."""
        if to is Tier.CPU:
            return self.reload_s(p)
        if to is Tier.DISK:
            return self.disk_reload_s(p)
        if isinstance(self.ranking, ReturnCost):
            return self.recompute_s(p) * self.ranking.delayed(replica, now)
        return self.recompute_s(p)

    def _spread_loads(self) -> tuple[int, ...] | None:
        return self.foreign_loads if self.config.spread_by_load else None

    # -- the moves the parts make (``Moves``) -------------------------------------------
    def _drop(self, p: Program, rnd: Round) -> None:
        """``p`` leaves the GPU or CPU tier for no faster tier: to its replica's disk
        where the disk tier takes it (``DiskTier.take``), else to none."""
        if self.disk is not None and self.disk.take(p, rnd):
            return
        self._demote_to(p, Tier.NONE, None, rnd.out)

    def _promote(self, p: Program, replica: int, out: list[Decision]) -> None:
        if p.tier is Tier.DISK and p.replica != replica:
            # its KV is on another replica's disk: that copy is dropped, it recomputes here
            self._demote_to(p, Tier.NONE, None, out)
        super()._promote(p, replica, out)

    def _forward_in(self, p: Program, rnd: Round) -> None:
        """Forward ``p``'s held request in round ``rnd``. While the promotions walk the
        index, the candidate's idleness this round is the one it was ranked by (its
        index key), before its step starts."""
        if rnd.walking:
            key = self.book.index.key_of(p.program_id)
            if key is not None:
                rnd.idleness.hold(p, key[2])
        self._forward(p, rnd.now, rnd.out)

    # -- the book kept up to date around every change of a program ----------------------

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
        if self.overcommit is not None and replica not in self.placement.down:
            self.placement.gpu[replica].capacity = self.overcommit.capacity()
        self.book.capacity_changed(replica)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.book.check()

    # -- the decision round (``mori_round``) --------------------------------------------
    def _decide(self, now: float, out: list[Decision]) -> None:
        oc = self.overcommit
        if oc is None:
            self._round(now, out)
            return
        oc.observe(now)  # the steps that ended since the last round
        oc.adjust(now)
        self._round(now, out)
        oc.observe(now)  # and the ones this round forwarded

    def _round(self, now: float, out: list[Decision]) -> None:
        if not self._ready and not self.book.grown and self.rebalancer is None:
            # no request held and no tier grew: no rule below has anything to do (the
            # most common round in a gateway, after each step's end); the candidate
            # index is brought up to date as the full round would
            self.book.flush()
            return
        rnd = Round.at(now, out)
        # 1. a variant's moves on every round
        if self.rebalancer is not None:
            self.rebalancer.rebalance(rnd)
        # 2. the queues a program grew past capacity: disk, then GPU and CPU
        if self.disk is not None and self.book.grown:
            self.disk.fix_overflow(self.book.grown, rnd)
        self.room.fix_overflow(rnd)
        # 3. requests held past the bound go first; one left waiting reserves its replica
        if self.aged is not None:
            rnd.held_for = self.aged.serve(rnd)
        # 4. the held requests of GPU-resident programs go
        if self._ready_gpu:
            for p in self.ready_on_gpu():
                self._forward(p, now, out)
        # 5. the other held requests, by priority
        self.promotion.run(rnd)
        # 6. every other replica makes room for its own first parked candidate
        if self.replica_room and self._ready:
            heads = self._replica_heads(rnd)
            if heads:
                self.room.each_replica(heads, rnd)
        # 7. an idle replica takes a held request
        if self.idle_fill is not None and self._ready:
            self.idle_fill.fill(rnd)
