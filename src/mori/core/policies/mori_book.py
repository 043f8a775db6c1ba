"""What ``MoriPolicy`` keeps up to date between decision rounds: ``MoriBook``.

The structures of ``mori_index`` (the held candidates by priority, per-replica sums,
the replicas ordered by room, the queues' programs most idle first), kept exact by the
policy's hooks around every change of a program (``unhook`` before, ``hook`` after),
and checked by ``check``. A part of the policy (``MoriPolicy.book``), not a floor of it:
the rules that read these structures (placement, room making, the round) read them
through the book's public fields.
"""

from __future__ import annotations

from collections.abc import Iterable

from mori.core.ledger import ClusterSpec, Placement
from mori.core.policies.mori_index import (
    AFFINE,
    CandidateIndex,
    IdlenessOrder,
    Priority,
    ReplicaOrder,
    ReplicaSums,
    priority,
)
from mori.core.policies.mori_round import IdlenessAt, Round
from mori.core.policy import PolicyConfig
from mori.core.program import Program
from mori.core.types import Status, Tier


class MoriBook:
    """MORI's indexes over a policy's programs (see the module docstring).

    ``placement``, ``programs`` and ``ready`` are the policy's own (shared, not copied).
    ``priority``: the promotion order its candidates are kept in (``mori_index``).
    """

    def __init__(self, placement: Placement, programs: dict[str, Program],
                 ready: dict[str, Program], cluster: ClusterSpec,
                 config: PolicyConfig, priority: Priority = priority) -> None:
        self.priority = priority
        self.placement = placement
        self.programs = programs
        self.ready = ready
        n = cluster.replicas
        cap = cluster.gpu_bytes
        # kept up to date as events arrive (mori_index); the index needs a held
        # program's priority to stay fixed, so held time must be excluded from idleness,
        # and it needs managed GPU capacities
        self.incremental = config.exclude_held and cap is not None
        self.cap = cap or 0
        """Each up replica's GPU capacity (one for all; ``mori_overcommit`` may change it)."""
        self.max_kv = self.cap
        """The largest context a candidate may have (the tiers as built)."""
        self.index = CandidateIndex(n)
        self.sums = ReplicaSums(n)
        self.avail = ReplicaOrder(n, self.cap)  # GPU free space beyond the reservation
        self._room = ReplicaOrder(n, self.cap)  # GPU free space + its Acting programs' KV
        self._room_stale: set[int] = set()  # and in _room (read only to place a new program)
        self._round: Round | None = None  # the round whose reservations ``avail``
        # counts, while the indexed promotions run (``attach``)
        self.open: set[int] = set()  # replicas where one of its CPU candidates may fit
        self._stale: set[int] = set()  # replicas whose membership of open is to check
        # per replica, most idle first at any time: its Acting GPU programs, and all of
        # its CPU queue (Acting and held)
        self.gpu_acting = [IdlenessOrder() for _ in range(n)]
        self.cpu_idle = [IdlenessOrder() for _ in range(n)]
        self._touched: dict[str, Program] = {}  # to re-index before the next round
        # replicas whose first CPU candidate (in priority order) fits their GPU's free
        # space plus their Acting programs' KV (``heads_fitting``), and those to recheck
        self._heads_ok: set[int] = set()
        self._heads_stale: set[int] = set()
        self.grown: set[tuple[Tier, int]] = set()  # queues that may be over capacity

    # -- bookkeeping around every change of a program -----------------------------------
    def resized(self, p: Program) -> None:
        if p.replica is not None:  # its queue may be over capacity now
            self.grown.add((p.tier, p.replica))

    def gone(self, program_id: str, was: int | None) -> None:
        if was is not None:
            self.sync(was)
        self._touched.pop(program_id, None)
        self.unindex(program_id)

    def unhook(self, p: Program) -> int | None:
        """Take ``p`` out of the sums and orders before a change; the GPU replica it
        was on."""
        self.sums.account(p, -1)
        if p.tier is Tier.GPU:
            assert p.replica is not None
            self.gpu_acting[p.replica].discard(p.program_id)
            return p.replica
        if p.tier is Tier.CPU:
            assert p.replica is not None
            self.cpu_idle[p.replica].discard(p.program_id)
        return None

    def hook(self, p: Program, was: int | None) -> None:
        """Put ``p`` back after a change (``was``: the GPU replica it was on)."""
        self.sums.account(p, +1)
        status = p.status
        if p.tier is Tier.CPU:
            assert p.replica is not None
            self.cpu_idle[p.replica].add(
                p, None if status is Status.ACTING else p.tracker.idleness(0.0))
        if p.tier is Tier.GPU:
            if status is Status.ACTING:
                assert p.replica is not None
                self.gpu_acting[p.replica].add(p, None)
            if p.replica != was:
                assert p.replica is not None
                self.sync(p.replica)
        if was is not None:
            self.sync(was)
        self._touched[p.program_id] = p

    # -- reads whose fast form needs the index (``incremental``), else a scan ------------
    def cpu_by_idleness(self, r: int, idleness: IdlenessAt) -> Iterable[Program]:
        """Replica ``r``'s CPU queue, most idle first (ties: the later request first)."""
        if self.incremental:
            return self.cpu_idle[r].descending(idleness, idleness.now)
        return sorted((self.programs[pid] for pid in self.placement.cpu[r].members),
                      key=idleness.desc)

    def most_idle_acting(self, r: int, need: float, idleness: IdlenessAt) -> list[Program]:
        """Replica ``r``'s Acting GPU programs, most idle first, until their KV covers
        ``need`` bytes (all of them if it never does; none if ``need`` <= 0)."""
        chosen: list[Program] = []
        acting = self.gpu_acting[r]
        for p in acting.descending(idleness, idleness.now) if need > 0 and len(acting) else ():
            if need <= 0:
                break
            chosen.append(p)
            need -= p.kv_bytes
        return chosen

    def acting_to_leave(self, r: int, need: float, idleness: IdlenessAt) -> list[Program]:
        """Replica ``r``'s Acting GPU programs that leave first when its queue is
        ``need`` bytes over capacity, most idle first (ties: the later request first):
        cut to what must leave from the replica's order, or every one of them sorted."""
        if self.incremental:
            return self.most_idle_acting(r, need, idleness)
        members = (self.programs[pid] for pid in self.placement.gpu[r].members)
        return sorted((p for p in members if p.status is Status.ACTING), key=idleness.desc)

    def reasoning_bytes(self, r: int) -> int:
        """The KV bytes of replica ``r``'s Reasoning GPU programs."""
        if self.incremental:
            return self.sums.reasoning[r]
        return sum(p.kv_bytes for p in (self.programs[pid] for pid in self.placement.gpu[r].members)
                   if p.status is Status.REASONING)

    def cap_of(self, r: int) -> int:
        """Replica ``r``'s GPU capacity now (0 while it is down)."""
        return 0 if r in self.placement.down else self.cap

    def capacity_changed(self, replica: int) -> None:
        self._room_stale.add(replica)
        self.sync(replica)

    def sync(self, r: int) -> None:
        """Replica ``r``'s GPU queue or its programs' statuses changed."""
        if not self.incremental:
            return
        rnd = self._round
        avail = (self.cap_of(r) - self.placement.gpu[r].used
                 - (rnd.reserve.get(r, 0) if rnd is not None else 0))
        if avail != self.avail[r]:
            self.avail.set(r, avail)
            self._stale.add(r)  # whether a CPU candidate of r fits may have changed
        self._room_stale.add(r)  # read rarely: brought up to date then
        self._heads_stale.add(r)

    def fresh_room(self) -> ReplicaOrder:
        """Each replica's GPU free space plus its Acting programs' KV, up to date."""
        gpus, acting = self.placement.gpu, self.sums.acting
        for r in self._room_stale:
            self._room.set(r, self.cap_of(r) - gpus[r].used + acting[r])
        self._room_stale.clear()
        return self._room

    def _head_fits(self, r: int) -> bool:
        first = self.index.cpu[r].first()
        return (first is not None
                and self.placement.gpu[r].free() + self.sums.acting[r] >= first[1])

    def heads_fitting(self) -> set[int]:
        """The replicas whose first CPU candidate in priority order fits their GPU's free
        space plus their Acting programs' KV, no reservation counted (incremental book
        only; not to be changed): rechecked only where something changed since the last
        call, so that a round reads the few replicas where room may be made, not all."""
        ok = self._heads_ok
        for r in self._heads_stale:
            if self._head_fits(r):
                ok.add(r)
            else:
                ok.discard(r)
        self._heads_stale.clear()
        return ok

    def unindex(self, pid: str) -> None:
        r = self.index.discard(pid)
        if r is not None:
            self._stale.add(r)
            self._heads_stale.add(r)

    def attach(self, rnd: Round) -> None:
        """Count ``rnd``'s reservations in ``avail`` until ``detach``: the indexed
        promotions (``mori_promote``) read the room beyond them from it."""
        self._round = rnd
        for r in rnd.reserve:
            self.sync(r)

    def detach(self) -> None:
        """End the attached round's reservations in ``avail``."""
        rnd = self._round
        self._round = None
        if rnd is not None:
            for r in rnd.reserve:
                self.sync(r)

    def flush(self) -> None:
        """Re-index the programs changed since the last flush (never while a round walks
        the index), and recheck which replicas may fit one of their CPU candidates."""
        assert self._round is None or not self._round.walking
        if not self.incremental:
            self._touched.clear()  # nothing is indexed
            return
        if not self._touched and not self._stale:
            return
        idx = self.index
        for pid, p in self._touched.items():
            if pid in idx:
                self.unindex(pid)
            if (p.ready and p.tier is not Tier.GPU and p.kv_bytes <= self.max_kv
                    and self.programs.get(pid) is p):
                idx.put(p, self.priority(p, p.tracker.idleness(0.0)))
                if p.replica is not None:
                    self._stale.add(p.replica)
                    self._heads_stale.add(p.replica)
        self._touched.clear()
        for r in self._stale:
            smallest = idx.cpu[r].min_size()
            if smallest is not None and smallest <= self.avail[r]:
                self.open.add(r)
            else:
                self.open.discard(r)
        self._stale.clear()

    def check(self) -> None:
        """Assert that every structure agrees with the programs (slow: for tests)."""
        n = len(self.placement.gpu)
        sums = ReplicaSums(n)
        for p in self.programs.values():
            sums.account(p, +1)
        assert (sums.acting, sums.reasoning, sums.gpu_used) == (
            self.sums.acting, self.sums.reasoning, self.sums.gpu_used), "GPU sums drifted"
        assert sum(gq.used for gq in self.placement.gpu) == self.sums.gpu_used
        for r in range(n):
            gpu = self.placement.gpu[r].members
            assert self.gpu_acting[r].ids() == {
                pid for pid in gpu if self.programs[pid].status is Status.ACTING}
            assert self.cpu_idle[r].ids() == set(self.placement.cpu[r].members)
        if not self.incremental:
            return
        self.flush()
        want = {pid: (self.priority(p, p.tracker.idleness(0.0)),
                      p.replica if p.tier in AFFINE else None)
                for pid, p in self.ready.items()
                if p.tier is not Tier.GPU and p.kv_bytes <= self.max_kv}
        assert self.index.entries() == want, "candidate index disagrees with the programs"
        for r, order in enumerate(self.index.cpu):
            assert all(c.tier in AFFINE and c.replica == r and kv == c.kv_bytes
                       for _, kv, c in order)
            gq = self.placement.gpu[r]
            assert self.avail[r] == self.cap_of(r) - gq.used, f"room of replica {r}"
            assert self.fresh_room()[r] == self.cap_of(r) - gq.used + self.sums.acting[r]
            smallest = order.min_size()
            assert (r in self.open) == (smallest is not None and smallest <= self.avail[r])
            if r not in self._heads_stale:
                assert (r in self._heads_ok) == self._head_fits(r), f"head of replica {r}"
        assert sorted(self.index.cpu_all) == sorted(t for o in self.index.cpu for t in o)
        assert all(c.tier is Tier.NONE and kv == c.kv_bytes
                   for _, kv, c in self.index.uncached)
        self.avail.check()
        self._room.check()

