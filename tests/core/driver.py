"""Test helpers for the policy core: a shadow replay of decision lists and a fake world.

``checked_decide`` wraps ``policy.decide`` and replays the decisions on a shadow copy of
the ledger taken just before, asserting at every point of the list that:

- a Release names a program that ended, with the replica it was on;
- a Demote names the tier and replica the program is on, never a Reasoning program;
- a Promote names the tier it comes from (GPU only for a move to another replica),
  and leaves the GPU of its replica within capacity (the Demotes that made room precede it); a Demote to CPU leaves the CPU
  within capacity;
- a Forward names a program that is in a GPU queue at that point of the list, on that
  replica, and that holds a request (each held request is forwarded once);

and that the shadow ends where the policy's ledger says, with ``check_integrity()``.

``FakeWorld`` drives a policy with closed-loop programs: each step's request arrives,
waits for a Forward, runs for its service time (an optional KVReady part way), then the
program acts for the tool gap and sends its next request, or ends after its last step.
Optionally replicas fail and come back (``outages``): the steps running there fail (their
request ends, the client sends it again), and some programs are found on the engines at
the start (``restored``), as a restarted gateway finds them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from mori.core.decisions import Decision, Demote, Forward, Promote, Release
from mori.core.events import (
    Event,
    KVReady,
    ProgramEnded,
    ProgramRestored,
    ReplicaDown,
    ReplicaUp,
    RequestArrived,
    StepFinished,
)
from mori.core.idleness import IdlenessHistory
from mori.core.policy import Policy
from mori.core.types import Status, Tier

Place = tuple[Tier, "int | None", int]


class DecisionError(AssertionError):
    """A decision list is inconsistent with the ledger it started from."""


def snapshot(p: Policy) -> dict[str, Place]:
    pl = p.placement
    out: dict[str, Place] = {}
    for pid in p.programs:
        tier, replica = pl.where(pid)
        out[pid] = (tier, replica, pl.queue(tier, replica)[pid])
    return out


def replay(p: Policy, before: dict[str, Place], held: set[str], reasoning: set[str],
           ended: dict[str, int | None], decisions: list[Decision]) -> set[str]:
    """Replay ``decisions`` on ``before``; returns the programs forwarded."""
    state = dict(before)
    forwarded: set[str] = set()

    def gpu_cap(r: int) -> int | None:  # per replica: a replica that is down holds 0
        return p.placement.gpu[r].capacity

    def cpu_cap(r: int | None) -> int | None:
        return p.placement.cpu[r].capacity if r is not None else None

    def disk_cap(r: int | None) -> int | None:
        return p.placement.disk[r].capacity if r is not None else None

    def used(tier: Tier, r: int | None) -> int:
        return sum(s for t, rr, s in state.values() if t is tier and rr == r)

    def fail(i: int, msg: str) -> DecisionError:
        return DecisionError(f"decision {i} {decisions[i]!r}: {msg}\nlist: {decisions!r}\n"
                             f"before: {before!r}")

    for i, d in enumerate(decisions):
        if isinstance(d, Release):
            if d.program_id not in ended:
                raise fail(i, "release of a program that did not end")
            if ended.pop(d.program_id) != d.replica:
                raise fail(i, "release names the wrong replica")
            if d.program_id in state:
                raise fail(i, "released program is still in the ledger")
            continue
        if d.program_id not in state:
            raise fail(i, "unknown program")
        tier, replica, size = state[d.program_id]
        if isinstance(d, Demote):
            if (tier, replica) != (d.source, d.replica):
                raise fail(i, f"program is in {tier.value}[{replica}]")
            if d.source is Tier.NONE or d.to not in (Tier.CPU, Tier.DISK, Tier.NONE):
                raise fail(i, "bad demotion tiers")
            if d.source is Tier.CPU and d.to not in (Tier.DISK, Tier.NONE):
                raise fail(i, "CPU demotes only to DISK or NONE")
            if d.source is Tier.DISK and d.to is not Tier.NONE:
                raise fail(i, "DISK demotes only to NONE")
            if d.to is Tier.DISK and not p.cluster.disk_bytes:
                raise fail(i, "demoted to a disk tier the cluster does not have")
            if d.program_id in reasoning:
                raise fail(i, "demoted a Reasoning program")
            if d.to is Tier.CPU:
                state[d.program_id] = (Tier.CPU, d.replica, size)
                cap = cpu_cap(d.replica)
                if cap is not None and used(Tier.CPU, d.replica) > cap:
                    raise fail(i, "CPU over capacity after the demotion")
            elif d.to is Tier.DISK:
                state[d.program_id] = (Tier.DISK, d.replica, size)
                cap = disk_cap(d.replica)
                if cap is not None and used(Tier.DISK, d.replica) > cap:
                    raise fail(i, "disk over capacity after the demotion")
            else:
                state[d.program_id] = (Tier.NONE, None, size)
        elif isinstance(d, Promote):
            if tier is not d.source or (tier is Tier.GPU and replica == d.replica):
                raise fail(i, f"program is in {tier.value}[{replica}]")
            if d.source in (Tier.CPU, Tier.DISK) and replica != d.replica:
                raise fail(i, f"{d.source.value} promotion to another replica")
            if not 0 <= d.replica < p.cluster.replicas:
                raise fail(i, "bad replica")
            state[d.program_id] = (Tier.GPU, d.replica, size)
            cap = gpu_cap(d.replica)
            if cap is not None and used(Tier.GPU, d.replica) > cap:
                raise fail(i, "GPU over capacity after the promotion")
        elif isinstance(d, Forward):
            if (tier, replica) != (Tier.GPU, d.replica):
                raise fail(i, f"forward while in {tier.value}[{replica}]")
            if d.program_id not in held or d.program_id in forwarded:
                raise fail(i, "forward of a program that holds no request")
            forwarded.add(d.program_id)
        else:  # pragma: no cover
            raise fail(i, "unknown decision")
    for pid, (tier, replica, size) in state.items():
        if p.placement.where(pid) != (tier, replica):
            raise DecisionError(f"{pid}: shadow {tier}[{replica}] != ledger "
                                f"{p.placement.where(pid)}; list {decisions!r}")
        if p.placement.queue(tier, replica)[pid] != size:
            raise DecisionError(f"{pid}: size changed during decide")
    if set(p.programs) != set(state):
        raise DecisionError("programs appeared or vanished during decide")
    return forwarded


def checked_decide(p: Policy, now: float, reasoning: set[str] | None = None,
                   ended: dict[str, int | None] | None = None) -> list[Decision]:
    """``p.decide(now)`` with the replay checks and ``check_integrity()``.

    ``reasoning``: programs the caller knows are executing a step (never demoted).
    ``ended``: program id -> replica it was on, for programs that ended since the last
    decide (defaults to the policy's pending releases)."""
    before = snapshot(p)
    held = {q.program_id for q in p.ready_programs}
    if reasoning is None:
        reasoning = {pid for pid, q in p.programs.items() if q.status is Status.REASONING}
    if ended is None:
        ended = {r.program_id: r.replica for r in p._releases}
    out = p.decide(now)
    replay(p, before, held, reasoning, dict(ended), out)
    p.check_integrity()
    check_no_idle_replica(p, out)
    return out


def check_no_idle_replica(p: Policy, decisions: list[Decision]) -> None:
    """Work conservation: no ready program that fits stays held while a replica it may
    use (its own for a CPU- or disk-queue program, any otherwise) has an empty GPU queue."""
    cap = p.cluster.gpu_bytes
    if cap is None:
        return
    for q in p.ready_programs:
        if q.kv_bytes > cap:
            continue
        usable = ([q.replica] if q.tier in (Tier.CPU, Tier.DISK)
                  else range(p.cluster.replicas))
        idle = [r for r in usable if r is not None and not p.placement.gpu[r].members
                and r not in p.placement.down]
        if idle:
            raise DecisionError(f"{q.program_id} ({q.kv_bytes} bytes, {q.tier.value}) held "
                                f"while GPU {idle} is empty; decisions {decisions!r}")


# -- the fake world -------------------------------------------------------------------------
@dataclass(frozen=True)
class StepSpec:
    growth: int  # tokens added to the context before this step's request (may be < 0)
    output: int  # tokens the step generates
    service: float  # seconds from Forward to StepFinished
    gap: float  # tool call after the step (before the next request, or the end)
    kv_frac: float | None  # KVReady at this fraction of the service time, or never


@dataclass(frozen=True)
class ProgramSpec:
    pid: str
    start: float
    steps: tuple[StepSpec, ...]

    def prompts(self) -> list[int]:
        """(prompt, context after the step) per step."""
        out, ctx = [], 0
        for s in self.steps:
            prompt = max(1, ctx + s.growth)
            ctx = prompt + s.output
            out.append((prompt, ctx))
        return out

    def peak(self) -> int:
        return max(max(a, b) for a, b in self.prompts())


@dataclass
class _Run:
    spec: ProgramSpec
    sizes: list[tuple[int, int]]
    step: int = 0
    held: bool = False
    reasoning: bool = False
    ended: bool = False
    forwards: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # per step: forwards that failed
    replica: int | None = None
    attempt: int = 0  # the running forward's number: events of a failed one are stale


class Liveness(AssertionError):
    """The world ran out of events (or time) with programs not ended."""


class FakeWorld:
    def __init__(self, policy: Policy, programs: list[ProgramSpec], time_limit: float,
                 tick: bool = True, batch: bool = False,
                 outages: list[tuple[float, float, int]] = (),  # type: ignore[assignment]
                 restored: list[tuple[str, int, int, Tier, IdlenessHistory | None]
                 ] = (),  # type: ignore[assignment]
                 queues: list[tuple[float, int, int]] = (),  # type: ignore[assignment]
                 ) -> None:
        """``batch``: observe every event of one instant before deciding once (the
        default decides after every observation). ``outages``: (down at, up at, replica).
        ``queues``: (at, replica, waiting): the engine of ``replica`` reports ``waiting``
        requests queued from then on (``Policy.set_engine_queues``).
        ``restored``: (program, context tokens, replica, tier, idleness history or None)
        found on the engines at time 0, before any request."""
        self.batch = batch
        self.p = policy
        self.runs = {s.pid: _Run(s, s.prompts(), forwards=[0] * len(s.steps),
                                 failed=[0] * len(s.steps)) for s in programs}
        self.down_count = [0] * policy.cluster.replicas
        self.limit = time_limit
        self.heap: list[tuple[float, int, str, str, int]] = []
        self.seq = 0
        self.now = 0.0
        self.trace: list[tuple[float, object]] = []
        self.pending_end: dict[str, int | None] = {}
        self.tick_s = policy.tick_interval if tick else None
        for pid, tokens, replica, tier, history in restored:
            self._observe(ProgramRestored(pid, tokens, replica, tier, history))
            self.runs[pid].replica = policy.programs[pid].replica
        for s in programs:
            self._at(s.start, "arrive", s.pid, 0)
        for down, up, replica in outages:
            self._at(down, "down", "", replica)
            self._at(up, "up", "", replica)
        self.waiting: list[int | None] = [None] * policy.cluster.replicas
        for at, replica, waiting in queues:
            self._at(at, "queue", str(waiting), replica)
        if self.tick_s is not None:
            self._at(self.tick_s, "tick", "", 0)

    def _at(self, t: float, kind: str, pid: str, step: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, pid, step))

    def _observe(self, ev: Event) -> None:
        self.trace.append((self.now, ev))
        self.p.observe(ev, self.now)

    def _decide(self) -> None:
        reasoning = {pid for pid, r in self.runs.items() if r.reasoning}
        if self.p.config.spread_by_load:  # what the engines would report: running steps
            loads = [0] * self.p.cluster.replicas
            for pid in reasoning:
                r = self.p.programs[pid].replica
                if r is not None:
                    loads[r] += 1
            self.p.set_foreign_loads(loads)
        out = checked_decide(self.p, self.now, reasoning, self.pending_end)
        self.pending_end.clear()
        self.trace.append((self.now, out))
        for d in out:
            if isinstance(d, Forward):
                run = self.runs[d.program_id]
                assert run.held and not run.reasoning and not run.ended, d
                run.held = False
                run.reasoning = True
                run.forwards[run.step] += 1
                run.replica = d.replica
                run.attempt += 1
                st = run.spec.steps[run.step]
                if st.kv_frac is not None:
                    self._at(self.now + st.kv_frac * st.service, "kv", d.program_id,
                             run.attempt)
                self._at(self.now + st.service, "finish", d.program_id, run.attempt)
            elif isinstance(d, (Promote, Demote)):
                run = self.runs[d.program_id]
                run.replica = d.replica if (isinstance(d, Promote)
                                            or d.to in (Tier.CPU, Tier.DISK)) else None
            elif isinstance(d, Release):
                assert self.runs[d.program_id].ended

    def _replica(self, replica: int, down: bool) -> None:
        """A replica fails (its running steps fail: each request ends with its prompt as
        the context, and the client sends it again at once) or comes back."""
        before = self.down_count[replica]
        self.down_count[replica] += 1 if down else -1
        if down and before == 0:
            self._observe(ReplicaDown(replica))
            for pid, run in self.runs.items():
                if run.replica != replica:
                    continue
                run.replica = None  # its KV there is gone (the policy moved it)
                if run.reasoning:
                    run.reasoning = False
                    run.attempt += 1  # its pending kv/finish events are stale
                    run.failed[run.step] += 1
                    self._observe(StepFinished(pid, run.sizes[run.step][0]))
                    self._at(self.now, "arrive", pid, run.step)
        elif not down and self.down_count[replica] == 0:
            self._observe(ReplicaUp(replica))

    def all_ended(self) -> bool:
        return all(r.ended for r in self.runs.values())

    def describe(self) -> str:
        lines = [f"t={self.now}"]
        for pid, r in self.runs.items():
            q = self.p.programs.get(pid)
            where = self.p.placement.where(pid) if pid in self.p.placement else "-"
            lines.append(f"  {pid}: step {r.step}/{len(r.spec.steps)} held={r.held} "
                         f"reasoning={r.reasoning} ended={r.ended} at {where} "
                         f"kv={q.kv_bytes if q else '-'} "
                         f"idleness={q.idleness(self.now) if q else '-'}")
        return "\n".join(lines)

    def run(self) -> None:
        while self.heap and not self.all_ended():
            t, _, kind, pid, step = heapq.heappop(self.heap)
            if t > self.limit:
                break
            self.now = t
            if kind == "tick":
                self._decide()
                assert self.tick_s is not None
                self._at(t + self.tick_s, "tick", "", 0)
                continue
            if kind in ("down", "up"):
                self._replica(step, kind == "down")
                self._decide()
                continue
            if kind == "queue":
                self.waiting[step] = int(pid)
                self.p.set_engine_queues(self.waiting, t)
                self._decide()
                continue
            run = self.runs[pid]
            if kind == "arrive":
                run.held = True
                self._observe(RequestArrived(pid, run.sizes[run.step][0]))
            elif kind == "kv":
                if step != run.attempt or not run.reasoning:
                    continue  # that forward failed with its replica
                self._observe(KVReady(pid))
            elif kind == "finish":
                if step != run.attempt or not run.reasoning:
                    continue
                step = run.step
                run.reasoning = False
                self._observe(StepFinished(pid, run.sizes[step][1]))
                gap = run.spec.steps[step].gap
                run.step += 1
                if run.step < len(run.spec.steps):
                    self._at(t + gap, "arrive", pid, run.step)
                else:
                    self._at(t + gap, "end", pid, step)
            elif kind == "end":
                run.ended = True
                self.pending_end[pid] = run.replica
                self._observe(ProgramEnded(pid))
            if self.batch and self.heap and self.heap[0][0] == t and self.heap[0][2] != "tick":
                continue
            self._decide()
        if not self.all_ended():
            raise Liveness("programs never finished (a ready program never forwarded?)\n"
                           + self.describe())
        for pid, run in self.runs.items():
            assert run.forwards == [1 + f for f in run.failed], (pid, run.forwards,
                                                                  run.failed)
        assert len(self.p.programs) == 0 and len(self.p.placement) == 0
        assert self.p.ready_programs == []
