"""MORI: rank by idleness, fill GPU then CPU exactly to capacity (docs/system.md, "Placement: rank, then fill each tier to capacity").

Every rule of section 4, and where a detail is ours:

- Sticky placement: nothing moves unless a tier is over capacity or a ready program
  needs room; the control loop runs on every tick and on every event.
- GPU over capacity (contexts grew): demote Acting programs before held (not yet
  forwarded) ones, highest iota first. Reasoning programs never grow in the ledger (it
  accounts a step's output when the step finishes), so they are never needed here.
- A demoted program goes to its replica's CPU queue if it fits; if not, CPU programs
  more idle than it are pushed to Waiting to make room (the CPU tier holds the next-best
  ranked); failing that it goes to Waiting itself. CPU over capacity: highest iota to
  Waiting first.
- Promotion order: (0) CPU-queue programs with a held request, (1) Waiting programs that
  are returning, (2) new programs, smallest context first; lowest iota first within a
  level; then arrival order.
- A candidate that fits is promoted and forwarded at once. A CPU-queue program goes back
  to its own replica (affinity: it reloads locally). Cacheless (Waiting) programs are
  admitted in priority order while the replicas' free space together holds them, and
  placed by Best-Fit-Decreasing: the largest first, each onto the replica where it fits
  most tightly. Ours, not the paper's: while memory does not bind (the GPU tiers, with
  the round's admitted programs added, would be at most ``SPREAD_BELOW`` full), each
  admitted program goes instead, largest first, to the replica holding the fewest
  programs that has room (ties: the tightest fit), so that at low load no replica sits
  idle while another runs everything (``mori-pack`` keeps the paper's rule).
- Proactive demotion: for the first candidate that does not fit, Acting programs on the
  GPU are demoted, highest iota first (a ready program outranks an idle one: ours, see
  ``_victim_ok``). If that is not enough but Reasoning programs would make up the rest,
  the Acting ones are demoted now and the replica's free space is reserved for the
  candidate (later candidates may only use space beyond the reservation); the Reasoning
  ones are demoted lazily: when their step ends, a later round finds them Acting and
  demotes them then. Otherwise nobody is demoted and it waits.
"""

from __future__ import annotations

from typing import NamedTuple

from mori.core.decisions import Decision
from mori.core.policy import EngineProfile, Policy
from mori.core.program import Program
from mori.core.types import Status, Tier

SPREAD_BELOW = 0.7
"""Admitted programs are spread by load while the GPU tiers would be at most this full."""


class MoriPolicy(Policy):
    name = "mori"
    description = "MORI: idleness-ranked GPU/CPU/Waiting placement with typed offloading"
    engine_profile = EngineProfile(cpu_tier=True, typed_eviction=True)
    uses_cpu_queue = True

    # -- ranking hooks (the ablations override these) --------------------------------
    def _victim_ok(self, victim_iota: float, cand_iota: float) -> bool:
        """May a program with ``victim_iota`` make room for one with ``cand_iota``?

        In MORI a ready program outranks every Acting one (it is about to reason, the
        other sits idle in a tool call); the ranking decides *which* Acting program
        goes: the most idle first. (Requiring ``victim_iota > cand_iota`` instead leaves
        the GPU idle while a ready program waits for a busy one's phase to change; we
        measured it: -20% throughput at 20 programs, see the README.)
        """
        return True

    def _displaceable(self, p: Program, now: float) -> bool:
        """May the Acting program ``p`` be demoted now to make room for a ready one?
        (Always in MORI; ``mori-ski`` waits until it has acted as long as a reload.)"""
        return True

    def _rebalance(self, now: float, out: list[Decision], iota: _Iota) -> None:
        """Moves made on every decision round regardless of demand (none for MORI)."""

    # -- the decision round ------------------------------------------------------------
    def _decide(self, now: float, out: list[Decision]) -> None:
        iota = _Iota(now)
        self._rebalance(now, out, iota)
        self._fix_overflow(out, iota)
        for p in sorted((q for q in self._ready.values() if q.tier is Tier.GPU),
                        key=lambda q: q.ready_seq):
            self._forward(p, now, out)
        self._promote_ready(now, out, iota)

    def _fix_overflow(self, out: list[Decision], iota: _Iota) -> None:
        pl = self.placement
        for r, gq in enumerate(pl.gpu):
            if gq.over():
                members = [self.programs[pid] for pid in gq.members]
                acting = [p for p in members if p.status is Status.ACTING]
                held = [p for p in members if p.status is Status.GATED]
                order = sorted(acting, key=iota.desc) + sorted(held, key=iota.desc)
                for p in order:
                    if not gq.over():
                        break
                    self._offload(p, r, out, iota)
                assert not gq.over(), "reasoning programs alone exceed the GPU tier"
        for cq in pl.cpu:
            if cq.over():
                for p in sorted((self.programs[pid] for pid in cq.members), key=iota.desc):
                    if not cq.over():
                        break
                    self._demote_to(p, Tier.NONE, None, out)

    def _offload(self, p: Program, replica: int, out: list[Decision], iota: _Iota,
                 keep: Program | None = None) -> None:
        """Demote ``p`` off the GPU of ``replica``: to CPU if it (can be made to) fit.

        ``keep`` (the program being made room for) is never pushed out of the CPU.
        """
        cq = self.placement.cpu[replica]
        if not cq.fits(p.kv_bytes) and cq.capacity:
            need = p.kv_bytes - int(cq.free())
            mine = iota(p)
            victims = []
            for q in sorted((self.programs[pid] for pid in cq.members), key=iota.desc):
                if need <= 0 or iota(q) <= mine:
                    break
                if q is keep:
                    continue
                victims.append(q)
                need -= q.kv_bytes
            if need <= 0:
                for q in victims:
                    self._demote_to(q, Tier.NONE, None, out)
        to = Tier.CPU if cq.fits(p.kv_bytes) and cq.capacity else Tier.NONE
        self._demote_to(p, to, replica, out)

    def _promote_ready(self, now: float, out: list[Decision], iota: _Iota) -> None:
        pl = self.placement
        cap = self.cluster.gpu_bytes
        cands = [p for p in self._ready.values() if p.tier is not Tier.GPU]
        if not cands:
            return

        def priority(p: Program) -> tuple[int, int, float, int]:
            level = 0 if p.tier is Tier.CPU else 1 if p.returning else 2
            return (level, p.tokens if level == 2 else 0, iota(p), p.ready_seq)

        cands.sort(key=priority)
        gpus = pl.gpu
        reserve = [0] * len(gpus)
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
            r = self._best_fit(c, reserve)
            if r is not None:
                place(c, r)
            elif not blocked:
                blocked = True
                self._make_room(c, now, out, iota, reserve)
                most = None

        # (0) CPU-queue programs: their own replica (affinity), in priority order
        for c in (c for c in cands if c.tier is Tier.CPU and not fits_nowhere(c)):
            place_or_make_room(c)
        # (1, 2) cacheless programs: *who* is admitted follows the priority order, as
        # long as the free space of all replicas together holds them; *where* is
        # Best-Fit-Decreasing: the largest first, each onto the replica it fits tightest
        waiting = [c for c in cands if c.tier is Tier.NONE and not fits_nowhere(c)]
        room = sum(max(0.0, gq.free() - reserve[r]) for r, gq in enumerate(gpus))
        batch: list[Program] = []
        for c in waiting:
            if c.kv_bytes > room:
                break
            batch.append(c)
            room -= c.kv_bytes
        order = sorted(batch, key=lambda p: (-p.kv_bytes, p.ready_seq))
        spread = self._spread(order, reserve)
        placed: set[str] = set()
        for c in order:
            r = spread[c.program_id] if spread is not None else self._best_fit(c, reserve)
            if r is not None:
                place(c, r)
                placed.add(c.program_id)
        # what is left: backfill into free space; the first that does not fit (if no
        # CPU-queue program did) may make room
        for c in waiting:
            if c.program_id not in placed:
                place_or_make_room(c)

    def _replicas_for(self, c: Program) -> list[int]:
        if c.tier is Tier.CPU and c.replica is not None:
            return [c.replica]  # affinity: reload locally
        return list(range(len(self.placement.gpu)))

    def _spread(self, order: list[Program], reserve: list[int]) -> dict[str, int] | None:
        """Where the admitted cacheless programs go instead of Best-Fit-Decreasing
        (program id -> replica), or None to pack them: spread while memory does not
        bind, each to the replica holding the fewest programs that has room."""
        gpus = self.placement.gpu
        n = len(gpus)
        if n == 1 or not order:
            return None
        total = sum(gq.capacity or 0 for gq in gpus)
        if sum(gq.used for gq in gpus) + sum(c.kv_bytes for c in order) > SPREAD_BELOW * total:
            return None  # memory binds: pack
        free = [gq.free() - reserve[r] for r, gq in enumerate(gpus)]
        # a replica's load: the programs it holds. With few programs most are Acting at
        # any instant, so the count balances their steps to come better than the
        # requests running now
        load = [len(gq.members) for gq in gpus]
        out: dict[str, int] = {}
        for c in order:
            fits = [r for r in range(n) if free[r] >= c.kv_bytes]
            if not fits:
                return None
            r = min(fits, key=lambda r: (load[r], free[r] - c.kv_bytes, r))
            out[c.program_id] = r
            free[r] -= c.kv_bytes
            load[r] += 1
        return out

    def _best_fit(self, c: Program, reserve: list[int]) -> int | None:
        best: tuple[float, int] | None = None
        for r in self._replicas_for(c):
            left = self.placement.gpu[r].free() - reserve[r] - c.kv_bytes
            if left >= 0 and (best is None or left < best[0]):
                best = (left, r)
        return None if best is None else best[1]

    def _make_room(self, c: Program, now: float, out: list[Decision], iota: _Iota,
                   reserve: list[int]) -> None:
        mine = iota(c)
        plans = []
        for r in self._replicas_for(c):
            gq = self.placement.gpu[r]
            members = [self.programs[pid] for pid in gq.members]
            acting = sorted((p for p in members if p.status is Status.ACTING
                             and self._victim_ok(iota(p), mine)
                             and self._displaceable(p, now)), key=iota.desc)
            reasoning = sum(p.kv_bytes for p in members if p.status is Status.REASONING
                            and self._victim_ok(iota(p), mine))
            room = gq.free() - reserve[r] + sum(p.kv_bytes for p in acting)
            plans.append(_RoomPlan(r, room, room + reasoning, acting))
        now_ok = [t for t in plans if t.room_now >= c.kv_bytes]
        if now_ok:  # placeable now: the replica needing the fewest demotions
            plan = max(now_ok, key=lambda t: (self.placement.gpu[t.replica].free()
                                              - reserve[t.replica], -t.replica))
        else:  # only after running steps end: the replica with the most room then
            plan = max(plans, key=lambda t: (t.room_later, -t.replica))
        if plan.room_later < c.kv_bytes:
            return  # cannot be made to fit yet: demote nobody, wait
        r = plan.replica
        gq = self.placement.gpu[r]
        for p in plan.acting:
            if gq.free() - reserve[r] >= c.kv_bytes:
                break
            self._offload(p, r, out, iota, keep=c)
        if gq.free() - reserve[r] >= c.kv_bytes:
            self._promote(c, r, out)
            self._forward(c, now, out)
            return
        # the Reasoning programs will make up the rest when their steps end (lazy
        # demotion: a later round demotes them as Acting programs); until then hold
        # what is free for c
        reserve[r] = max(reserve[r], int(gq.free()))


class _RoomPlan(NamedTuple):
    """How one replica could make room for a candidate (``_make_room``)."""

    replica: int
    room_now: float  # free space beyond the reservation, plus the Acting victims' KV
    room_later: float  # the same, once the Reasoning victims' steps have ended
    acting: list[Program]  # the Acting victims, most idle first


class _Iota:
    """Idleness of each program, computed once per decision round."""

    __slots__ = ("now", "_memo")

    def __init__(self, now: float) -> None:
        self.now = now
        self._memo: dict[str, float] = {}

    def __call__(self, p: Program) -> float:
        v = self._memo.get(p.program_id)
        if v is None:
            v = p.tracker.iota(self.now)
            self._memo[p.program_id] = v
        return v

    def desc(self, p: Program) -> tuple[float, int]:
        """Sort key: highest iota first, then the most recent request last in."""
        return (-self(p), -p.ready_seq)
