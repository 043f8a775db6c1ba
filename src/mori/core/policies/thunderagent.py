"""The ThunderAgent baselines: ThunderAgent's scheduler as its source has it.

This follows ThunderAgent's own scheduler (``ThunderAgent/scheduler/router.py`` and
``backend/state.py`` of its MIT-licensed source, ``wiki/Scheduler.md``; TR mode), rule
for rule; the code here is ours. A cross-check test drives the real router class and
this policy with the same scripted programs and asserts the same pause and resume
decisions (``tests/core/test_thunderagent_crosscheck.py``).

- **Capacity**, per backend, in tokens: ``reasoning + acting_token_weight x acting +
  100 x programs`` against the engine's KV pool, where reasoning and acting are the
  summed token counts of the backend's active programs by status (a program with a
  request, held or running, is Reasoning), and 100 tokens per program is the decode
  buffer. The shared-prefix term of the formula is always 0: ThunderAgent never calls
  the code that would update it.
- **A new program** (its first request) goes at once to the backend with the fewest
  active tokens among those with room for it and its buffer, if no program is paused;
  otherwise it joins the paused queue.
- **Every 5 s** (``tick_s``) the scheduler first resumes, then pauses:
  - *resume*: the paused programs, smallest first within each group and the groups in
    the order: those with a held request that ran before, new programs (whose request
    count is 1), then those without a request; taken while their tokens plus buffers fit
    the backends' total remaining capacity, then placed largest first, each on the
    backend with the most remaining capacity (skipping one too large for it; stopping
    when even the smallest selected fits nowhere);
  - *pause*, on each backend over capacity: its Acting programs, smallest first; when
    none is left, its Reasoning programs are marked, smallest first, and paused when
    their step ends. (ThunderAgent's loop tests the remaining capacity, which marking
    does not change, so it marks every Reasoning program of a backend still over
    capacity.)
- A program held for 30 minutes is resumed regardless of capacity, on the backend it
  was paused from (a new one: the backend with the fewest programs).
- A paused program's KV is left to the engine: ThunderAgent stops counting it and tells
  the engine nothing, so the engine's own LRU decides whether it survives. The ledger
  therefore does not bound the GPU tier (the engine does); the capacity rules above are
  the scheduler's own accounting.
- ``acting_token_decay`` (ThunderAgent's ``--use-acting-token-decay``): resume counts
  an Acting program's tokens as ``tokens x 2^-t``, t the seconds since its step ended.

``thunderagent+offload`` is the same scheduler in front of an engine with a CPU KV tier
managed by plain LRU, not coordinated with the scheduler.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from dataclasses import dataclass

from mori.core.decisions import Decision
from mori.core.events import ProgramEnded, ProgramRestored, RequestArrived, StepFinished
from mori.core.ledger import ClusterSpec
from mori.core.policy import EngineProfile, Policy, PolicyConfig
from mori.core.program import Program
from mori.core.types import Status, Tier

BUFFER_PER_PROGRAM = 100
"""Tokens ThunderAgent reserves per active program for decode headroom."""

FORCE_RESUME_S = 1800.0
"""Seconds a held program waits before ThunderAgent resumes it regardless of capacity."""


@dataclass(slots=True)
class _Paused:
    """An entry of the paused queue: the program's tokens and request count when it
    was paused, and the backend it left (None for a new program); ``seq`` is its place
    in the queue (later entries larger)."""

    tokens: int
    requests: int
    origin: int | None
    seq: int = 0


class ThunderAgentPolicy(Policy):
    name = "thunderagent"
    description = "ThunderAgent's scheduler: capacity by tokens, pause smallest Acting, no offload"
    engine_profile = EngineProfile(cpu_tier=False, typed_eviction=False, drops_on_demote=False)

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        gpu = cluster.gpu_bytes
        self.capacity_tokens: float = float("inf") if gpu is None else gpu // kv_bytes_per_token
        super().__init__(cluster, kv_bytes_per_token, config)
        self.paused: dict[str, _Paused] = {}  # ThunderAgent's global waiting queue, in order
        # the same programs in resume's groups (_resume_group), each ascending by
        # (tokens when paused, place in the queue): resume's order, kept as they change
        self._groups: tuple[list[tuple[int, int, str]], ...] = ([], [], [])
        self._group_of: dict[str, int] = {}
        self._paused_seq = 0
        self.marked: set[str] = set()  # Reasoning programs to pause when their step ends
        self.requests: dict[str, int] = {}  # requests each program has sent (step_count)
        self._acting_since: dict[str, float] = {}
        self._held_since: dict[str, float] = {}  # programs waiting in the paused queue
        self._held_heap: list[tuple[float, str]] = []  # the same, earliest first (lazily)
        self._events: list[tuple[str, str]] = []  # ("new" | "pause", program) to handle
        self._next_check = self.config.tick_s
        # per backend the summed tokens of its Reasoning and of its Acting programs, kept
        # up to date at every change (what _tokens would sum over the members)
        self._reasoning_tokens = [0] * cluster.replicas
        self._acting_tokens = [0] * cluster.replicas
        self._table_no: dict[str, int] = {}  # each program's place in the program table
        self._table_next = 0

    # -- bookkeeping around every change of a program (Policy._unhook / _hook) ----------
    def _unhook(self, p: Program) -> int | None:
        self._count(p, -1)
        return None

    def _hook(self, p: Program, was: int | None) -> None:
        self._count(p, +1)
        if p.program_id not in self._table_no:
            self._table_no[p.program_id] = self._table_next
            self._table_next += 1

    def _gone(self, program_id: str, was: int | None) -> None:
        self._table_no.pop(program_id, None)

    def _count(self, p: Program, sign: int) -> None:
        if p.tier is Tier.GPU:
            assert p.replica is not None
            sums = self._reasoning_tokens if self._reasoning(p) else self._acting_tokens
            sums[p.replica] += sign * p.tokens

    def check_integrity(self) -> None:
        super().check_integrity()
        want: tuple[list[tuple[int, int, str]], ...] = ([], [], [])
        for pid, info in self.paused.items():
            want[self._resume_group(pid)].append((info.tokens, info.seq, pid))
            if self._resume_group(pid):  # no request since the pause: tokens unchanged
                assert self.programs[pid].tokens == info.tokens, f"tokens of paused {pid}"
        assert self._groups == tuple(sorted(g) for g in want), "paused groups drifted"
        assert list(self.paused) == sorted(self.paused, key=lambda q: self.paused[q].seq)
        for r in range(self.cluster.replicas):
            reasoning = acting = 0
            for pid in self.placement.gpu[r].members:
                p = self.programs[pid]
                if self._reasoning(p):
                    reasoning += p.tokens
                else:
                    acting += p.tokens
            assert (reasoning, acting) == self._tokens(r), f"token sums of backend {r}"
        assert list(self._table_no) == list(self.programs), "program table order"

    def _ledger_spec(self, cluster: ClusterSpec) -> ClusterSpec:
        return ClusterSpec(cluster.replicas, None, 0)  # the engine bounds memory

    # -- observations -----------------------------------------------------------------
    def _on_arrival(self, ev: RequestArrived, now: float) -> None:
        super()._on_arrival(ev, now)
        pid = ev.program_id
        self.requests[pid] = self.requests.get(pid, 0) + 1
        self._acting_since.pop(pid, None)
        if pid in self.paused:
            self._hold_since(pid, now)
            self._regroup(pid)
        elif self.programs[pid].tier is not Tier.GPU:
            self._events.append(("new", pid))

    def _on_restored(self, ev: ProgramRestored, now: float) -> None:
        known = ev.program_id in self.programs
        super()._on_restored(ev, now)
        if not known:  # it ran before the restart: one request counted, as for a program
            self.requests[ev.program_id] = 1  # between two steps

    def _on_replica(self, replica: int, down: bool, now: float) -> None:
        pl = self.placement
        moved = [*pl.gpu[replica].members, *pl.cpu[replica].members] if down else []
        super()._on_replica(replica, down, now)
        for pid in moved:  # now in Uncached: no pause to make, a held request to admit
            self.marked.discard(pid)
            if self.programs[pid].status is Status.HELD and pid not in self.paused:
                self._events.append(("new", pid))

    def _on_finish(self, ev: StepFinished, now: float) -> None:
        super()._on_finish(ev, now)
        self._acting_since[ev.program_id] = now
        if ev.program_id in self.marked:
            self._events.append(("pause", ev.program_id))

    def _on_end(self, ev: ProgramEnded, now: float) -> None:
        super()._on_end(ev, now)
        pid = ev.program_id
        self._unpause(pid)
        for d in (self.requests, self._acting_since, self._held_since):
            d.pop(pid, None)
        self.marked.discard(pid)

    # -- the paused queue ------------------------------------------------------------------
    def _resume_group(self, pid: str) -> int:
        """Resume's group of a paused program: 0 a held request of one that ran before,
        1 a new program (request count 1), 2 no request."""
        if self.requests.get(pid, 0) == 1:
            return 1
        return 0 if self._reasoning(self.programs[pid]) else 2

    def _enqueue(self, pid: str, info: _Paused) -> None:
        assert pid not in self.paused, f"{pid} paused twice"
        self._paused_seq += 1
        info.seq = self._paused_seq
        self.paused[pid] = info
        g = self._resume_group(pid)
        insort(self._groups[g], (info.tokens, info.seq, pid))
        self._group_of[pid] = g

    def _unpause(self, pid: str) -> None:
        info = self.paused.pop(pid, None)
        if info is not None:
            group = self._groups[self._group_of.pop(pid)]
            del group[bisect_left(group, (info.tokens, info.seq))]

    def _regroup(self, pid: str) -> None:
        """A paused program's request count or status changed."""
        g = self._resume_group(pid)
        old = self._group_of[pid]
        if g != old:
            info = self.paused[pid]
            group = self._groups[old]
            del group[bisect_left(group, (info.tokens, info.seq))]
            insort(self._groups[g], (info.tokens, info.seq, pid))
            self._group_of[pid] = g

    # -- the scheduler's accounting ------------------------------------------------------
    def _reasoning(self, p: Program) -> bool:
        return p.status is not Status.ACTING

    def _tokens(self, replica: int) -> tuple[int, int]:
        """The summed tokens of the backend's Reasoning and of its Acting programs."""
        return self._reasoning_tokens[replica], self._acting_tokens[replica]

    def remaining(self, replica: int, now: float | None = None) -> float:
        """The backend's remaining capacity in tokens (negative when over); with ``now``,
        the decayed estimate resume uses under ``acting_token_decay``; none while the
        replica is down)."""
        if replica in self.placement.down:
            return float("-inf")
        members = self.placement.gpu[replica].members
        if now is None:
            reasoning, acting = self._tokens(replica)
            weighted = reasoning + self.config.acting_token_weight * acting
        else:  # ThunderAgent's decayed estimate weighs each Acting program by 2^-t alone
            weighted = 0.0
            for pid in members:
                p = self.programs[pid]
                if self._reasoning(p):
                    weighted += p.tokens
                elif pid in self._acting_since:
                    weighted += p.tokens * 2.0 ** -(now - self._acting_since[pid])
        return self.capacity_tokens - (int(weighted) + BUFFER_PER_PROGRAM * len(members))

    def _active_tokens(self, replica: int) -> int:
        reasoning, acting = self._tokens(replica)
        return int(reasoning + self.config.acting_token_weight * acting)

    # -- decisions ----------------------------------------------------------------------
    def _decide(self, now: float, out: list[Decision]) -> None:
        events, self._events = self._events, []
        for kind, pid in events:
            p = self.programs.get(pid)
            if p is None:
                continue
            if kind == "new":
                self._admit_new(p, now, out)
            elif pid in self.marked and p.status is Status.ACTING:
                self.marked.discard(pid)
                self._pause(p, out)
        for p in self.ready_on_gpu():
            self._forward(p, now, out)
        if self._force_due(now):
            for pid, since in list(self._held_since.items()):
                if now - since >= FORCE_RESUME_S and pid in self.paused:
                    self._force_resume(self.programs[pid], now, out)
        if now >= self._next_check:
            while self._next_check <= now:
                self._next_check += self.config.tick_s
            self._greedy_resume(now, out)
            for r in range(self.cluster.replicas):
                if self.remaining(r) < 0:
                    self._pause_until_safe(r, out)

    def _hold_since(self, pid: str, now: float) -> None:
        self._held_since[pid] = now
        heapq.heappush(self._held_heap, (now, pid))

    def _force_due(self, now: float) -> bool:
        """Whether a paused request has waited ``FORCE_RESUME_S`` (the scan of all of
        them then runs, in their order); entries since resumed are dropped lazily."""
        heap, since = self._held_heap, self._held_since
        while heap and since.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return bool(heap) and now - heap[0][0] >= FORCE_RESUME_S

    def _admit_new(self, p: Program, now: float, out: list[Decision]) -> None:
        """A new program's first request: to the backend with the fewest active tokens
        that has room, if nothing is paused; otherwise into the paused queue."""
        best: int | None = None
        if not self.paused:
            least = float("inf")
            for r in range(self.cluster.replicas):
                if self.remaining(r) < p.tokens + BUFFER_PER_PROGRAM:
                    continue
                active = self._active_tokens(r)
                if active < least:
                    least, best = active, r
        if best is not None:
            self._resume(p, best, now, out)
        else:
            self._enqueue(p.program_id, _Paused(p.tokens, self.requests[p.program_id], None))
            self._hold_since(p.program_id, now)

    def _pause(self, p: Program, out: list[Decision]) -> None:
        assert p.replica is not None and p.tier is Tier.GPU
        self._enqueue(p.program_id, _Paused(p.tokens, self.requests.get(p.program_id, 0),
                                            p.replica))
        self._demote_to(p, Tier.NONE, None, out)

    def _resume(self, p: Program, replica: int, now: float, out: list[Decision]) -> None:
        self._unpause(p.program_id)
        self._held_since.pop(p.program_id, None)
        self._promote(p, replica, out)
        if p.ready:
            self._forward(p, now, out)

    def _force_resume(self, p: Program, now: float, out: list[Decision]) -> None:
        origin = self.paused[p.program_id].origin
        down = self.placement.down
        if origin is None or origin in down:  # the backend with the fewest programs, the
            up = [r for r in range(len(self.placement.gpu)) if r not in down]  # first on
            if not up:  # a tie (of those not down)
                return
            origin = min(up, key=lambda r: (len(self.placement.gpu[r].members), r))
        self._resume(p, origin, now, out)

    def _greedy_resume(self, now: float, out: list[Decision]) -> None:
        decay = self.config.acting_token_decay
        caps: list[tuple[int, float]] = []
        for r in range(self.cluster.replicas):
            rem = self.remaining(r, now if decay else None)
            if rem > BUFFER_PER_PROGRAM:
                caps.append((r, rem))
        total = sum(rem for _, rem in caps)
        if not caps or total <= 0 or not self.paused:
            return
        chosen = self._to_resume(total)
        if not chosen:
            return
        chosen.sort(key=lambda p: -p.tokens)
        caps.sort(key=lambda c: -c[1])
        smallest = chosen[-1].tokens + BUFFER_PER_PROGRAM
        for p in chosen:
            if not caps or smallest > caps[0][1]:
                break
            need = p.tokens + BUFFER_PER_PROGRAM
            if need > caps[0][1]:
                continue
            r, rem = caps[0]
            self._resume(p, r, now, out)
            left = rem - need
            if left > BUFFER_PER_PROGRAM:
                caps[0] = (r, left)
                caps.sort(key=lambda c: -c[1])
            else:
                caps.pop(0)

    def _to_resume(self, total: float) -> list[Program]:
        """The paused programs resume takes, in its order: by group (_resume_group),
        each group smallest first (tokens when paused; ties: queue order), every one
        taken that still fits ``total`` with those taken before it (tokens + buffer)."""
        programs = self.programs
        held, new, idle = self._groups
        chosen: list[Program] = []
        cumulative = 0
        for _, _, pid in held:
            p = programs[pid]
            need = p.tokens + BUFFER_PER_PROGRAM
            if cumulative + need <= total:
                chosen.append(p)
                cumulative += need
        for group in (new, idle):
            # no request since the pause: their tokens are those they were paused with,
            # so the group is ascending in need and none after the first miss fits
            for tokens, _, pid in group:
                need = tokens + BUFFER_PER_PROGRAM
                if cumulative + need > total:
                    break
                chosen.append(programs[pid])
                cumulative += need
        return chosen

    def _pause_until_safe(self, replica: int, out: list[Decision]) -> None:
        members = self.placement.gpu[replica].members
        # in program-table order, so that equal sizes break ties as ThunderAgent's do
        on = sorted((self.programs[pid] for pid in members),
                    key=lambda p: self._table_no[p.program_id])
        while self.remaining(replica) < 0:
            acting = sorted((p for p in on if p.status is Status.ACTING),
                            key=lambda p: p.tokens)
            if acting:
                self._pause(acting[0], out)
                on.remove(acting[0])
                continue
            reasoning = sorted((p for p in on if self._reasoning(p)
                                and p.program_id not in self.marked), key=lambda p: p.tokens)
            if not reasoning:
                break
            self.marked.add(reasoning[0].program_id)


class ThunderAgentOffloadPolicy(ThunderAgentPolicy):
    name = "thunderagent+offload"
    description = "ThunderAgent with an uncoordinated LRU CPU tier in the engine (TA+O)"
    engine_profile = EngineProfile(cpu_tier=True, typed_eviction=False, drops_on_demote=False)
