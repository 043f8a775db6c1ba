"""The ``Policy`` interface and the bookkeeping every policy shares.

A policy is pure and synchronous: a world (the simulator, the gateway) reports what
happened with ``observe(event, now)`` and asks ``decide(now)`` for what to do; decisions
are data (``mori.core.decisions``) that the world executes in order. The policy updates
its own ledger as it decides, so after ``decide`` returns, ``placement`` describes the
state the decisions lead to and ``check_integrity()`` holds, capacities included.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from mori.core.decisions import Decision, Demote, Forward, Promote, Release
from mori.core.engine_costs import EngineCosts
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
from mori.core.idleness import IdlenessHistory, IdlenessTracker
from mori.core.ledger import ClusterSpec, Placement
from mori.core.load import ReplicaLoad
from mori.core.program import Program, ProgramView, StepRecord
from mori.core.types import Status, Tier

DEFAULT_MAX_WAIT_S = 3600.0
"""``PolicyConfig.max_wait_s`` unless set: an hour. Bounds that fire within the
paper's one-hour runs cost MORI throughput there (docs/results.md, "Bounded waiting")."""

DEFAULT_RELOAD_GBPS = 25.0
"""GB/s assumed for a KV reload when the world gives none (PCIe 4/5 x16, pinned)."""

DEFAULT_DISK_READ_GBPS = 14.0
"""GB/s assumed for a reload from the disk tier when the world gives none (one PCIe
Gen5 NVMe drive's sequential read, docs/costmodel.md, "The disk tier")."""

DEFAULT_RECOMPUTE_TOK_S = 20_000.0
"""Tokens a second assumed for recomputing a context when the world gives no rate (the
cost model's presets prefill a 32k context at 15-30k tokens/s per replica)."""

DEFAULT_LOAD_WINDOW_S = 60.0
"""``PolicyConfig.load_window_s`` unless set: a replica's busy share follows the last
minute or so of policy time (``mori.core.load``)."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs shared by the policies (each ignores those it has no use for).

    ``tick_s``: period of the control loop (docs/system.md, "Placement: rank, then fill each tier to capacity": 5 s).
    ``idleness_window``: k, cycles in the idleness window (docs/system.md, "Idleness": 5).
    ``exclude_held``: leave held (scheduler-imposed) time out of idleness.
    ``binary_threshold``: idleness at or above which ``mori-binary`` calls a program idle.
    ``page_tokens``: KV is accounted in whole pages of this many tokens.
    ``acting_token_weight``: the weight of an Acting program's tokens in ThunderAgent's
    capacity (its ``--acting-token-weight``, 1.0).
    ``acting_token_decay``: ThunderAgent's ``--use-acting-token-decay``: resume counts
    an Acting program's tokens as ``tokens x 2^-t``, t seconds since its step ended.
    ``reload_gbps``: the host-to-GPU bandwidth of a KV reload as the policies estimate
    it, GB/s of policy time (None: the simulator gives its modelled link; elsewhere
    ``DEFAULT_RELOAD_GBPS``; 0: a reload is priced as never ending, so ``mori`` parks
    nobody at once).
    ``recompute_tok_s``: the rate of a recompute as the policies estimate it (``mori``
    prices a drop by it, ``mori-yield`` a yield), tokens
    per second of policy time (None: the simulator gives its cost model's; elsewhere
    ``DEFAULT_RECOMPUTE_TOK_S``).
    ``max_wait_s``: MORI's bound on waiting: a request held this many seconds goes ahead
    of every other promotion (None or 0: no bound, the paper's rule).
    ``spread_by_load``: MORI's spreading of admitted cacheless programs (while memory
    does not bind) prefers the replica with the fewest requests that are not the
    policy's own, as last told by ``Policy.set_foreign_loads`` (in the gateway: what the
    engines report beyond the gateway's requests, i.e. other clients'), then the most
    room; off (the default), or with no loads told, the most room alone. The policy's
    own programs are already weighed by the room they take.
    ``disk_read_gbps``: the rate of a reload from a replica's disk tier as the policies
    estimate it, GB/s of policy time (None: the simulator gives its modelled disk;
    elsewhere ``DEFAULT_DISK_READ_GBPS``); ``disk_latency_s`` is added once per reload.
    Used only where the cluster has a disk tier.
    ``load_window_s``: the time constant, in policy seconds, of each replica's recent
    busy share (``mori.core.load``), by which ``mori`` scales the price of a drop (a
    recompute delays others only while the engine has work); None or 0: the price
    assumes an engine that is always busy.
    ``fill_idle``: ``mori``'s work conservation: a replica with no step running takes a
    held request at once, its Acting programs leaving for it (``mori_idle_fill``).
    ``gpu_overcommit``: the GPU tier a policy with typed eviction fills, as a multiple of
    the engine's GPU KV pool (1: the pool, the paper's rule). Above 1 the policy places
    more programs on the GPU than the pool holds and holds fewer requests; the engine
    keeps what fits and evicts the rest of the cached KV in MORI's label order, the most
    idle first (``Policy._overcommitted``). ``gpu_overcommit_max``: above
    ``gpu_overcommit``, ``mori``'s tier follows the engine between the two
    (``mori_overcommit``): larger while requests are held and the engine keeps up,
    smaller when the requests in flight overrun its pool, looking every
    ``gpu_overcommit_period_s`` (None: the load window; a gateway makes it at least four
    of its readings of the engines). Measured: docs/benchmarks.md ("The GPU tier
    overcommitted").
    """

    tick_s: float = 5.0
    idleness_window: int = 5
    exclude_held: bool = True
    binary_threshold: float = 0.5
    page_tokens: int = 64
    acting_token_weight: float = 1.0
    acting_token_decay: bool = False
    reload_gbps: float | None = None
    recompute_tok_s: float | None = None
    max_wait_s: float | None = DEFAULT_MAX_WAIT_S
    spread_by_load: bool = False
    disk_read_gbps: float | None = None
    disk_latency_s: float = 0.0
    load_window_s: float | None = DEFAULT_LOAD_WINDOW_S
    fill_idle: bool = False
    gpu_overcommit: float = 1.0
    gpu_overcommit_max: float = 1.0
    gpu_overcommit_period_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpu_overcommit", "gpu_overcommit_max"):
            x = getattr(self, name)
            if not (x >= 1 and math.isfinite(x)):
                raise ValueError(f"{name} must be a finite number >= 1, got {x}")
        period = self.gpu_overcommit_period_s
        if period is not None and not (period > 0 and math.isfinite(period)):
            raise ValueError("gpu_overcommit_period_s must be a positive number of seconds, "
                             f"got {period}")
        if not (self.tick_s > 0 and math.isfinite(self.tick_s)):
            raise ValueError(f"tick_s must be a positive number of seconds, got {self.tick_s}")
        if self.idleness_window < 1:
            raise ValueError(f"idleness_window must be >= 1, got {self.idleness_window}")
        if not 0.0 <= self.binary_threshold <= 1.0:
            raise ValueError(f"binary_threshold must be in [0, 1], got {self.binary_threshold}")
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if self.reload_gbps is not None and not (self.reload_gbps >= 0
                                                 and math.isfinite(self.reload_gbps)):
            raise ValueError(f"reload_gbps must be a number >= 0, got {self.reload_gbps}")
        if self.recompute_tok_s is not None and not (self.recompute_tok_s > 0
                                                     and math.isfinite(self.recompute_tok_s)):
            raise ValueError("recompute_tok_s must be a positive number, got "
                             f"{self.recompute_tok_s}")
        if self.max_wait_s is not None and not (self.max_wait_s >= 0
                                                and math.isfinite(self.max_wait_s)):
            raise ValueError("max_wait_s must be a finite number of seconds >= 0, got "
                             f"{self.max_wait_s}")
        if self.disk_read_gbps is not None and not (self.disk_read_gbps > 0
                                                    and math.isfinite(self.disk_read_gbps)):
            raise ValueError("disk_read_gbps must be a positive number, got "
                             f"{self.disk_read_gbps}")
        if not (self.disk_latency_s >= 0 and math.isfinite(self.disk_latency_s)):
            raise ValueError("disk_latency_s must be a finite number of seconds >= 0, got "
                             f"{self.disk_latency_s}")
        if self.load_window_s is not None and not (self.load_window_s >= 0
                                                   and math.isfinite(self.load_window_s)):
            raise ValueError("load_window_s must be a finite number of seconds >= 0, got "
                             f"{self.load_window_s}")
        if not (self.acting_token_weight >= 0 and math.isfinite(self.acting_token_weight)):
            raise ValueError("acting_token_weight must be a finite number >= 0, got "
                             f"{self.acting_token_weight}")


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """What the engine under a policy looks like (the paper's deployments).

    ``cpu_tier``: the engine keeps a CPU KV pool (HiCache / offload connector).
    ``typed_eviction``: the engine orders eviction and batch admission by MORI's type
    labels; otherwise plain LRU and first-come admission.
    ``drops_on_demote``: a demotion off the GPU tells an untyped engine to offload or
    drop the program's KV; False: the engine is told nothing and its LRU decides (a
    ThunderAgent pause).
    """

    cpu_tier: bool
    typed_eviction: bool
    drops_on_demote: bool = True


class Policy(ABC):
    """Base class: program table, ledger and the observation handling all share.

    Subclasses implement ``_decide(now, out)``. Contract of ``decide``: every held
    request of a GPU-resident program is eventually forwarded; nothing is forwarded
    unless its program is in a GPU queue; no tier is over capacity on return.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    engine_profile: ClassVar[EngineProfile]
    uses_cpu_queue: ClassVar[bool] = False  # whether the scheduler keeps a CPU queue
    uses_disk_queue: ClassVar[bool] = False  # whether it keeps a disk queue (when the
    # cluster has a disk tier)

    def __init__(self, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig | None = None) -> None:
        if kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
        self.config = config or PolicyConfig()
        self.kv_bytes_per_token = kv_bytes_per_token
        spec = self._ledger_spec(cluster)
        self.pool_gpu_bytes = spec.gpu_bytes
        """Each replica's engine GPU pool (None: not managed), before any overcommit."""
        self.cluster = self._overcommitted(spec)
        self.placement = Placement(self.cluster)
        self.programs: dict[str, Program] = {}
        self._ready: dict[str, Program] = {}  # programs holding a request
        self._ready_gpu: dict[str, Program] = {}  # of those, the ones on a GPU
        # (ready_seq, program) by arrival, for held_since; entries of requests forwarded
        # since are dropped as they are met, and all at once when they are most of it
        self._arrivals: deque[tuple[int, Program]] = deque()
        self._releases: list[Release] = []
        self._seq = 0
        self.decisions_taken = 0
        self.foreign_loads: tuple[int, ...] | None = None  # see set_foreign_loads
        self.load = ReplicaLoad(self.cluster.replicas,
                                self.config.load_window_s or DEFAULT_LOAD_WINDOW_S)
        self.engine_costs: list[EngineCosts | None] = [None] * self.cluster.replicas

    # -- the interface ----------------------------------------------------------------
    @property
    def tick_interval(self) -> float | None:
        """Seconds between control-loop ticks, or None if the policy needs no tick."""
        return self.config.tick_s

    def observe(self, event: Event, now: float) -> None:
        """Record what happened at ``now``; call ``decide`` afterwards."""
        if isinstance(event, KVReady):  # no change of status, tier or size
            p = self.programs.get(event.program_id)
            if p is not None and p.status is Status.REASONING:
                p.tracker.started(now)  # the interval since the forward becomes held
            return
        if isinstance(event, ReplicaDown | ReplicaUp):
            self._on_replica(event.replica, isinstance(event, ReplicaDown), now)
            return
        if isinstance(event, ProgramRestored):
            self._on_restored(event, now)
            return
        pid = event.program_id
        p = self.programs.get(pid)
        was = self._unhook(p) if p is not None else None
        try:
            if isinstance(event, RequestArrived):
                self._on_arrival(event, now)
            elif isinstance(event, StepFinished):
                self._on_finish(event, now)
            elif isinstance(event, ProgramEnded):
                self._on_end(event, now)
            else:  # pragma: no cover - exhaustive
                raise TypeError(f"unknown event {event!r}")
        finally:
            q = self.programs.get(pid)
            if q is not None:
                self._hook(q, was)
            else:
                self._gone(pid, was)

    def decide(self, now: float) -> list[Decision]:
        """What to do now; the ledger is updated as if the decisions were executed."""
        out: list[Decision] = list(self._releases)
        self._releases.clear()
        self._decide(now, out)
        self.decisions_taken += 1
        return out

    def set_foreign_loads(self, loads: Sequence[int]) -> None:
        """Tell the policy how many requests that are not its own each replica is serving
        or queueing now (a world's reading of its engines: other clients' requests;
        used with ``PolicyConfig.spread_by_load``)."""
        if len(loads) != self.cluster.replicas:
            raise ValueError(f"{len(loads)} replica loads for {self.cluster.replicas} "
                             "replicas")
        if any(n < 0 for n in loads):
            raise ValueError(f"replica loads must be >= 0, got {list(loads)}")
        self.foreign_loads = tuple(loads)

    def set_engine_queues(self, waiting: Sequence[int | None], now: float,
                          running: Sequence[int | None] | None = None) -> None:
        """Tell the policy how many requests each replica's engine reports waiting for
        admission at ``now`` (None: no reading; taken as no queue), and, where given, how
        many it reports running (None: no reading). Each replica's queue share
        (``ReplicaLoad.queue_share``) follows the waiting counts, its engine's busy share
        (``ReplicaLoad.engine_busy_share``) the running ones."""
        n_rep = self.cluster.replicas
        if len(waiting) != n_rep or (running is not None and len(running) != n_rep):
            raise ValueError(f"{len(waiting)} waiting and "
                             f"{'no' if running is None else len(running)} running engine "
                             f"readings for {n_rep} replicas")
        for counts in (waiting, running or ()):
            if any(n is not None and n < 0 for n in counts):
                raise ValueError(f"engine counts must be >= 0, got {list(counts)}")
        for r, n in enumerate(waiting):
            self.load.queued(r, bool(n), now)
        for r, m in enumerate(running or ()):
            if m is not None:
                self.load.engine_running(r, m > 0, now)

    def check_integrity(self) -> None:
        self.placement.check_integrity(capacity=True)
        for pid, p in self.programs.items():
            tier, replica = self.placement.where(pid)
            assert (p.tier, p.replica) == (tier, replica), f"{pid}: program/ledger disagree"
            assert (pid in self._ready) == (p.status is Status.HELD), (
                f"{pid}: {p.status.value} but {'in' if pid in self._ready else 'not in'} "
                "the index of held requests")
            assert (pid in self._ready_gpu) == (p.ready and p.tier is Tier.GPU), (
                f"{pid}: the index of held requests on a GPU")
        assert len(self.placement) == len(self.programs)

    @property
    def ready_programs(self) -> list[Program]:
        return list(self._ready.values())

    def held_since(self, cutoff: float) -> Iterator[Program]:
        """The held requests that arrived at or before ``cutoff``, oldest first."""
        arrivals, ready = self._arrivals, self._ready
        while arrivals:  # drop what was forwarded or ended from the front
            seq, p = arrivals[0]
            if ready.get(p.program_id) is p and p.ready_seq == seq:
                break
            arrivals.popleft()
        for seq, p in arrivals:
            if ready.get(p.program_id) is p and p.ready_seq == seq:  # not stale
                if p.ready_at > cutoff:
                    return
                yield p

    def ready_on_gpu(self) -> list[Program]:
        """The held requests of GPU-resident programs, in arrival order."""
        return sorted(self._ready_gpu.values(), key=lambda q: q.ready_seq)

    # -- read-only queries (inspection; they change nothing) ------------------------------
    @property
    def held_count(self) -> int:
        """How many programs have a request held (status HELD)."""
        return len(self._ready)

    def view(self, program_id: str, now: float) -> ProgramView | None:
        p = self.programs.get(program_id)
        return None if p is None else ProgramView.of(p, now)

    def views(self, now: float) -> list[ProgramView]:
        """Every program, by id."""
        return [ProgramView.of(self.programs[pid], now) for pid in sorted(self.programs)]

    def status_counts(self) -> dict[tuple[Tier, Status], int]:
        """Programs per (tier, status)."""
        counts: dict[tuple[Tier, Status], int] = {}
        for p in self.programs.values():
            key = (p.tier, p.status)
            counts[key] = counts.get(key, 0) + 1
        return counts

    # -- helpers for subclasses ---------------------------------------------------------
    @abstractmethod
    def _decide(self, now: float, out: list[Decision]) -> None: ...

    # Every change of a program's status, tier, replica or size (an observation, a
    # forward, a move) runs between ``_unhook`` and ``_hook``, so a subclass can keep
    # indexes of its programs up to date instead of scanning them; ``_gone`` follows
    # an observation after which the program no longer exists.
    def _unhook(self, p: Program) -> int | None:
        """Before ``p`` changes; what it returns is handed to ``_hook`` (``mori``: the
        GPU replica ``p`` was on)."""
        return None

    def _hook(self, p: Program, was: int | None) -> None:  # noqa: B027 - a no-op hook
        """After ``p`` changed."""

    def _gone(self, program_id: str, was: int | None) -> None:  # noqa: B027 - a no-op hook
        """After ``program_id`` ended (or its first request was refused)."""

    def _capacity_changed(self, replica: int) -> None:  # noqa: B027 - a no-op hook
        """After a replica went down (its capacities 0) or came back."""

    def histories(self, now: float) -> Iterator[tuple[str, IdlenessHistory]]:
        """Each program's idleness history at ``now`` (what ``ProgramRestored`` takes
        back after a restart)."""
        for pid, p in self.programs.items():
            yield pid, p.tracker.history(now)

    def gpu_capacity(self, replica: int) -> int | None:
        """The GPU capacity of ``replica`` now: the cluster's, 0 while it is down."""
        return self.placement.gpu[replica].capacity

    def _ledger_spec(self, cluster: ClusterSpec) -> ClusterSpec:
        """The capacities this policy schedules against (a subclass may drop a tier)."""
        if self.uses_cpu_queue:
            if self.uses_disk_queue or not cluster.disk_bytes:
                return cluster
            return ClusterSpec(cluster.replicas, cluster.gpu_bytes, cluster.cpu_bytes)
        return ClusterSpec(cluster.replicas, cluster.gpu_bytes, 0)

    def _overcommitted(self, spec: ClusterSpec) -> ClusterSpec:
        """``spec`` with its GPU tier ``PolicyConfig.gpu_overcommit`` times the engine's
        pool, for a policy whose engine evicts by its labels (an untyped engine's LRU
        would not evict the programs the policy ranks last)."""
        x = self.config.gpu_overcommit
        if x == 1 or spec.gpu_bytes is None or not self.engine_profile.typed_eviction:
            return spec
        return dataclasses.replace(spec, gpu_bytes=int(spec.gpu_bytes * x))

    def set_engine_costs(self, replica: int, costs: EngineCosts) -> None:
        """Price ``replica``'s moves by what its engine was measured to charge
        (``mori.core.engine_costs``, in policy seconds); a price left None keeps the
        configured rate."""
        if not 0 <= replica < self.cluster.replicas:
            raise ValueError(f"no replica {replica} (the cluster has "
                             f"{self.cluster.replicas})")
        self.engine_costs[replica] = costs

    def _costs_of(self, p: Program) -> EngineCosts | None:
        return self.engine_costs[p.replica] if p.replica is not None else None

    def reload_s(self, p: Program) -> float:
        """Seconds a reload of ``p``'s KV is estimated to take: its replica's learned
        price where there is one (``set_engine_costs``), else ``reload_gbps`` (inf at
        0 GB/s: no usable link, whatever was learned)."""
        gbps = DEFAULT_RELOAD_GBPS if self.config.reload_gbps is None else self.config.reload_gbps
        if gbps <= 0:
            return math.inf
        c = self._costs_of(p)
        if c is not None and c.reload_fixed_s is not None and c.reload_per_token_s is not None:
            return c.reload_fixed_s + c.reload_per_token_s * p.tokens
        return p.kv_bytes / (gbps * 1e9)

    def reload_engine_s(self, p: Program) -> float:
        """The engine time a reload of ``p``'s KV takes, as its replica's engine was
        measured to charge it (``set_engine_costs``: a fixed part and a part per token,
        timed as the engine's own); 0 where none was measured: a reload over a GPU's link
        overlaps the engine's compute, as the paper assumes."""
        c = self._costs_of(p)
        if c is None or c.reload_fixed_s is None or c.reload_per_token_s is None:
            return 0.0
        return c.reload_fixed_s + c.reload_per_token_s * p.tokens

    def disk_reload_s(self, p: Program) -> float:
        """Seconds a reload of ``p``'s KV from its replica's disk tier is estimated to
        take (``disk_read_gbps`` plus ``disk_latency_s``)."""
        gbps = self.config.disk_read_gbps or DEFAULT_DISK_READ_GBPS
        return self.config.disk_latency_s + p.kv_bytes / (gbps * 1e9)

    def recompute_s(self, p: Program) -> float:
        """Seconds a recompute of ``p``'s context is estimated to take: its replica's
        learned price where there is one, else ``recompute_tok_s``."""
        c = self._costs_of(p)
        if c is not None and c.recompute_per_token_s is not None:
            return c.recompute_per_token_s * p.tokens
        return p.tokens / (self.config.recompute_tok_s or DEFAULT_RECOMPUTE_TOK_S)

    def hold_reason(self, program_id: str, now: float) -> str | None:
        """Why ``program_id``'s request is held, in one line (None: it is not held, or
        the policy does not say). A reading of the state now, not a promise."""
        return None

    def return_cost(self, p: Program, to: Tier, replica: int, now: float) -> float:
        """What ``p``'s return will cost, in policy seconds, having left ``replica``'s
        GPU for ``to`` at ``now``: a reload where it was parked (from the CPU tier or the disk
        tier), else a recompute (the policy's estimates, ``reload_s``, ``disk_reload_s``
        and ``recompute_s``; a policy may count more)."""
        if to is Tier.CPU:
            return self.reload_s(p)
        return self.disk_reload_s(p) if to is Tier.DISK else self.recompute_s(p)

    def bytes_for(self, tokens: int) -> int:
        page = self.config.page_tokens
        return -(-tokens // page) * page * self.kv_bytes_per_token

    def _forward(self, p: Program, now: float, out: list[Decision]) -> None:
        assert p.tier is Tier.GPU and p.replica is not None and p.ready
        out.append(Forward(p.program_id, p.replica))
        was = self._unhook(p)
        del self._ready[p.program_id]
        del self._ready_gpu[p.program_id]
        p.tracker.started(now)  # status: REASONING
        self.load.started(p.program_id, p.replica, now)
        self._hook(p, was)
        if p.history:
            p.history[-1].forwarded = now

    def _promote(self, p: Program, replica: int, out: list[Decision]) -> None:
        out.append(Promote(p.program_id, replica, p.tier))
        self._move(p, Tier.GPU, replica)

    def _demote_to(self, p: Program, to: Tier, replica: int | None,
                   out: list[Decision]) -> None:
        assert p.replica is not None, f"{p.program_id}: demoted from no tier"
        out.append(Demote(p.program_id, p.replica, p.tier, to))
        self._move(p, to, replica if to is not Tier.NONE else None)

    def _move(self, p: Program, tier: Tier, replica: int | None) -> None:
        was = self._unhook(p)
        self.placement.move(p.program_id, tier, replica)
        p.tier, p.replica = tier, replica
        if tier is Tier.GPU and p.ready:
            self._ready_gpu[p.program_id] = p
        else:
            self._ready_gpu.pop(p.program_id, None)
        self._hook(p, was)

    # -- observation handling -----------------------------------------------------------
    def _on_arrival(self, ev: RequestArrived, now: float) -> None:
        p = self.programs.get(ev.program_id)
        if p is None:
            p = Program(ev.program_id, IdlenessTracker(self.config.idleness_window,
                                                       self.config.exclude_held))
            self.programs[ev.program_id] = p
            self.placement.add(ev.program_id, 0)
        elif p.status is not Status.ACTING:
            raise ValueError(
                f"program {ev.program_id!r} sent a request while {p.status.value}: "
                "a program has at most one request in flight"
            )
        p.tracker.arrived(now)  # status: HELD, the request is held
        self._seq += 1
        p.ready_seq = self._seq
        p.ready_at = now
        self._ready[p.program_id] = p
        arrivals = self._arrivals
        arrivals.append((self._seq, p))
        if len(arrivals) > 2 * len(self._ready) + 64:
            # mostly forwarded entries: keep the held ones (``_ready`` is in arrival order)
            self._arrivals = deque((q.ready_seq, q) for q in self._ready.values())
        if p.tier is Tier.GPU:
            self._ready_gpu[p.program_id] = p
        self._resize(p, ev.prompt_tokens)
        p.record(StepRecord(arrived=now))

    def _on_finish(self, ev: StepFinished, now: float) -> None:
        p = self.programs[ev.program_id]
        if p.status is not Status.REASONING:
            raise ValueError(f"program {ev.program_id!r} finished while {p.status.value}")
        p.tracker.finished(now)  # status: ACTING
        self.load.finished(p.program_id, now)
        p.returning = True
        p.steps_done += 1
        self._resize(p, ev.context_tokens)
        if p.history:
            p.history[-1].finished = now

    def _on_replica(self, replica: int, down: bool, now: float) -> None:
        """``ReplicaDown``: every program on the replica goes to Uncached (its KV there is
        lost: its next step recomputes), then the replica takes nothing until
        ``ReplicaUp``. No decision is issued for the moves: the engine is gone."""
        if not 0 <= replica < self.cluster.replicas:
            raise ValueError(f"bad replica {replica!r}")
        if down == (replica in self.placement.down):
            return
        if down:
            self.load.lost(replica, now)
            for q in (self.placement.gpu[replica], self.placement.cpu[replica],
                      self.placement.disk[replica]):
                for pid in list(q.members):
                    p = self.programs[pid]
                    self._move(p, Tier.NONE, None)
                    p.returning = True
        self.placement.set_down(replica, down)
        self._capacity_changed(replica)

    def _on_restored(self, ev: ProgramRestored, now: float) -> None:
        """A program found on an engine (``ProgramRestored``): Acting (with its history,
        if the event brings one), in its place if that fits, else in Uncached."""
        if ev.program_id in self.programs:
            return
        if not 0 <= ev.replica < self.cluster.replicas or ev.tier is Tier.NONE:
            raise ValueError(f"bad place {ev.tier.value}[{ev.replica}]")
        p = Program(ev.program_id, IdlenessTracker(self.config.idleness_window,
                                                   self.config.exclude_held))
        p.tracker.restored(now, ev.history)
        p.returning = True
        self._seq += 1
        p.ready_seq = self._seq  # orders it among equals, as an arrival would
        self.programs[ev.program_id] = p
        self.placement.add(ev.program_id, 0)
        self._resize(p, max(0, ev.context_tokens))
        self._hook(p, None)  # a new program, in Uncached (as a first arrival is)
        if self.placement.tier_queue(ev.tier, ev.replica).fits(p.kv_bytes):
            self._move(p, ev.tier, ev.replica)

    def _on_end(self, ev: ProgramEnded, now: float) -> None:
        p = self.programs.pop(ev.program_id)
        self.load.finished(p.program_id, now)
        self._ready.pop(p.program_id, None)
        self._ready_gpu.pop(p.program_id, None)
        self.placement.remove(p.program_id)
        self._releases.append(Release(p.program_id, p.replica))

    def _resize(self, p: Program, tokens: int) -> None:
        p.tokens = tokens
        p.kv_bytes = self.bytes_for(tokens)
        self.placement.resize(p.program_id, p.kv_bytes)
