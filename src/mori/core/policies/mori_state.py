"""What ``MoriPolicy`` keeps up to date between decision rounds, and how.

``MoriState`` is the bookkeeping half of MORI: the structures of ``mori_index`` (the
held candidates by priority, per-replica sums, the replicas ordered by room, the queues'
programs most idle first), kept exact by the base policy's hooks around every change of
a program, and checked by ``check_integrity``. The rules that use them are in
``mori.core.policies.mori``.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.ledger import ClusterSpec
from mori.core.policies.mori_index import (
    CandidateIndex,
    IdlenessOrder,
    ReplicaOrder,
    ReplicaSums,
    priority,
)
from mori.core.policy import Policy, PolicyConfig
from mori.core.program import Program
from mori.core.types import Status, Tier


class MoriState(Policy):
    """The program table of ``Policy`` plus MORI's indexes (see the module docstring)."""

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        super().__init__(cluster, kv_bytes_per_token, config)
        n = self.cluster.replicas
        cap = self.cluster.gpu_bytes
        # kept up to date as events arrive (mori_index); the index needs a held
        # program's priority to stay fixed, so gated time must be excluded from idleness,
        # and it needs managed GPU capacities
        self._incremental = self.config.exclude_gated and cap is not None
        self._cap = cap or 0
        self._index = CandidateIndex(n)
        self._sums = ReplicaSums(n)
        self._avail = ReplicaOrder(n, self._cap)  # GPU free space beyond the reservation
        self._room = ReplicaOrder(n, self._cap)  # GPU free space + its Acting programs' KV
        self._room_stale: set[int] = set()  # and in _room (read only to place a new program)
        self._round_reserve: dict[int, int] = {}  # the round's reservation (_make_room)
        self._open: set[int] = set()  # replicas where one of its CPU candidates may fit
        self._stale: set[int] = set()  # replicas whose membership of _open is to check
        # per replica, most idle first at any time: its Acting GPU programs, and all of
        # its CPU queue (Acting and held)
        self._gpu_acting = [IdlenessOrder() for _ in range(n)]
        self._cpu_idle = [IdlenessOrder() for _ in range(n)]
        self._touched: dict[str, Program] = {}  # to re-index before the next round
        self._grown: set[tuple[Tier, int]] = set()  # queues that may be over capacity
        self._frozen = False  # inside a round's promotions: the index is being walked
        self._round_idleness: IdlenessAt | None = None  # the round's idleness while frozen
        self._aged_wait: tuple[str, int] = ("", -1)  # the request past the bound that
        # waits for its replica's steps to end, and that replica (``_serve_aged``)

    # -- bookkeeping around every change of a program (Policy._unhook / _hook) ----------
    def _forward(self, p: Program, now: float, out: list[Decision]) -> None:
        if self._round_idleness is not None:
            # a candidate's idleness as the round ranked it (held), before its step starts
            key = self._index.key_of(p.program_id)
            if key is not None:
                self._round_idleness.hold(p, key[2])
        super()._forward(p, now, out)

    def _resize(self, p: Program, tokens: int) -> None:
        super()._resize(p, tokens)
        if p.replica is not None:  # its queue may be over capacity now
            self._grown.add((p.tier, p.replica))

    def _gone(self, program_id: str, was: int | None) -> None:
        if was is not None:
            self._sync(was)
        self._touched.pop(program_id, None)
        self._unindex(program_id)

    def _unhook(self, p: Program) -> int | None:
        """Take ``p`` out of the sums and orders before a change; the GPU replica it
        was on."""
        self._sums.account(p, -1)
        if p.tier is Tier.GPU:
            assert p.replica is not None
            self._gpu_acting[p.replica].discard(p.program_id)
            return p.replica
        if p.tier is Tier.CPU:
            assert p.replica is not None
            self._cpu_idle[p.replica].discard(p.program_id)
        return None

    def _hook(self, p: Program, was: int | None) -> None:
        self._sums.account(p, +1)
        status = p.status
        if p.tier is Tier.CPU:
            assert p.replica is not None
            self._cpu_idle[p.replica].add(
                p, None if status is Status.ACTING else p.tracker.idleness(0.0))
        if p.tier is Tier.GPU:
            if status is Status.ACTING:
                assert p.replica is not None
                self._gpu_acting[p.replica].add(p, None)
            if p.replica != was:
                assert p.replica is not None
                self._sync(p.replica)
        if was is not None:
            self._sync(was)
        self._touched[p.program_id] = p

    def _cap_of(self, r: int) -> int:
        """Replica ``r``'s GPU capacity now (0 while it is down)."""
        return 0 if r in self.placement.down else self._cap

    def _capacity_changed(self, replica: int) -> None:
        self._room_stale.add(replica)
        self._sync(replica)

    def _sync(self, r: int) -> None:
        """Replica ``r``'s GPU queue or its programs' statuses changed."""
        if not self._incremental:
            return
        avail = self._cap_of(r) - self.placement.gpu[r].used - self._round_reserve.get(r, 0)
        if avail != self._avail[r]:
            self._avail.set(r, avail)
            self._stale.add(r)  # whether a CPU candidate of r fits may have changed
        self._room_stale.add(r)  # read rarely: brought up to date then

    def _fresh_room(self) -> ReplicaOrder:
        """``_room``, up to date."""
        gpus, acting = self.placement.gpu, self._sums.acting
        for r in self._room_stale:
            self._room.set(r, self._cap_of(r) - gpus[r].used + acting[r])
        self._room_stale.clear()
        return self._room

    def _unindex(self, pid: str) -> None:
        r = self._index.discard(pid)
        if r is not None:
            self._stale.add(r)

    def _flush(self) -> None:
        """Re-index the programs changed since the last flush (not while walking), and
        recheck which replicas may fit one of their CPU candidates."""
        assert not self._frozen
        if not self._touched and not self._stale:
            return
        idx = self._index
        for pid, p in self._touched.items():
            if pid in idx:
                self._unindex(pid)
            if (p.ready and p.tier is not Tier.GPU and p.kv_bytes <= self._cap
                    and self.programs.get(pid) is p):
                idx.put(p, priority(p, p.tracker.idleness(0.0)))
                if p.replica is not None:
                    self._stale.add(p.replica)
        self._touched.clear()
        for r in self._stale:
            smallest = idx.cpu[r].min_size()
            if smallest is not None and smallest <= self._avail[r]:
                self._open.add(r)
            else:
                self._open.discard(r)
        self._stale.clear()

    def check_integrity(self) -> None:
        super().check_integrity()
        sums = ReplicaSums(self.cluster.replicas)
        for p in self.programs.values():
            sums.account(p, +1)
        assert (sums.acting, sums.reasoning, sums.gpu_used) == (
            self._sums.acting, self._sums.reasoning, self._sums.gpu_used), "GPU sums drifted"
        assert sum(gq.used for gq in self.placement.gpu) == self._sums.gpu_used
        for r in range(self.cluster.replicas):
            gpu = self.placement.gpu[r].members
            assert self._gpu_acting[r].ids() == {
                pid for pid in gpu if self.programs[pid].status is Status.ACTING}
            assert self._cpu_idle[r].ids() == set(self.placement.cpu[r].members)
        if not self._incremental:
            return
        self._flush()
        want = {pid: (priority(p, p.tracker.idleness(0.0)),
                      p.replica if p.tier is Tier.CPU else None)
                for pid, p in self._ready.items()
                if p.tier is not Tier.GPU and p.kv_bytes <= self._cap}
        assert self._index.entries() == want, "candidate index disagrees with the programs"
        for r, order in enumerate(self._index.cpu):
            assert all(c.tier is Tier.CPU and c.replica == r and kv == c.kv_bytes
                       for _, kv, c in order)
            gq = self.placement.gpu[r]
            assert self._avail[r] == self._cap_of(r) - gq.used, f"room of replica {r}"
            assert self._fresh_room()[r] == self._cap_of(r) - gq.used + self._sums.acting[r]
            smallest = order.min_size()
            assert (r in self._open) == (smallest is not None and smallest <= self._avail[r])
        assert sorted(self._index.cpu_all) == sorted(t for o in self._index.cpu for t in o)
        assert all(c.tier is Tier.NONE and kv == c.kv_bytes
                   for _, kv, c in self._index.waiting)
        self._avail.check()
        self._room.check()


class IdlenessAt:
    """Idleness of each program, computed once per decision round."""

    __slots__ = ("now", "_memo")

    def __init__(self, now: float) -> None:
        self.now = now
        self._memo: dict[str, float] = {}

    def __call__(self, p: Program) -> float:
        v = self._memo.get(p.program_id)
        if v is None:
            v = p.tracker.idleness(self.now)
            self._memo[p.program_id] = v
        return v

    def hold(self, p: Program, value: float) -> None:
        """Take ``value`` as ``p``'s idleness this round unless one was computed already."""
        self._memo.setdefault(p.program_id, value)

    def desc(self, p: Program) -> tuple[float, int]:
        """Sort key: highest idleness first, then the most recent request last in."""
        return (-self(p), -p.ready_seq)
