"""Executing decisions: one mapping from ``Decision`` to engine actions, for both worlds.

A policy's decisions say *where* programs go; what an engine must be told follows from
the decision, the engine the policy assumes (its ``engine_profile``) and the controls the
replica offers (its ``Capability`` set). That mapping lives here, once:

=====================  =============================================================
decision               engine actions
=====================  =============================================================
``Forward``            ``Submit`` the held request to the replica
``Promote``            typed engine with ``LABELS``: label the program busy
``Demote`` to CPU      typed engine with ``LABELS``: label it idle; otherwise, leaving
                       the GPU: ``Offload`` its GPU KV (engine with ``OFFLOAD``)
``Demote`` to NONE     typed engine with ``LABELS``: label it inactive; otherwise,
                       leaving the GPU: ``Offload`` (engine with ``OFFLOAD``: the host
                       tier keeps it if there is one) or else ``Drop`` (with ``DROP``);
                       nothing where the profile's ``drops_on_demote`` is off
``Release``            ``ReleaseKV`` on every replica (its KV is inactive)
=====================  =============================================================

An ``EngineTarget`` is what a world offers the executor: the simulator calls its engine
replicas directly, the gateway schedules the adapters' controls in order per replica.
``DecisionExecutor`` applies the actions to a target, counts what it executed and keeps
the ``DecisionLog`` the inspection endpoints and the parity test read.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from mori.core.decisions import Decision, Demote, Forward, Promote, Release
from mori.core.explain import ContextReader, DecisionContext
from mori.core.explain import reason as reason_for
from mori.core.policy import EngineProfile
from mori.core.types import Capability, KVLabel, Tier


# -- engine actions --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Submit:
    """Send the program's held request to ``replica``. ``reload``: it was promoted from
    the CPU tier in the same round (its KV comes back over PCIe; a world may prefetch)."""

    program_id: str
    replica: int
    reload: bool = False


@dataclass(frozen=True, slots=True)
class SetLabel:
    """Give the program's KV on ``replica`` an eviction label."""

    program_id: str
    replica: int
    label: KVLabel


@dataclass(frozen=True, slots=True)
class Offload:
    """Push the program's GPU KV on ``replica`` out now (to the host tier, if any)."""

    program_id: str
    replica: int


@dataclass(frozen=True, slots=True)
class Drop:
    """Forget the program's KV on ``replica`` in every tier now."""

    program_id: str
    replica: int


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """The program ended: its KV on every replica is inactive."""

    program_id: str


EngineAction = Submit | SetLabel | Offload | Drop | ReleaseKV

_DEMOTE_LABEL = {Tier.CPU: KVLabel.IDLE, Tier.NONE: KVLabel.INACTIVE}


def engine_actions(d: Decision, profile: EngineProfile, caps: frozenset[Capability],
                   reload: bool = False) -> tuple[EngineAction, ...]:
    """What the engine of ``d``'s replica must be told (the table above).

    ``profile`` is the engine the policy assumes; ``caps`` the controls the replica of
    ``d`` offers (ignored for ``Release``, which every replica hears). ``reload``: for
    a ``Forward``, the program was promoted from the CPU tier just before.
    """
    if isinstance(d, Forward):
        return (Submit(d.program_id, d.replica, reload),)
    if isinstance(d, Release):
        return (ReleaseKV(d.program_id),)
    labels = profile.typed_eviction and Capability.LABELS in caps
    if isinstance(d, Promote):
        return (SetLabel(d.program_id, d.replica, KVLabel.BUSY),) if labels else ()
    if labels:
        return (SetLabel(d.program_id, d.replica, _DEMOTE_LABEL[d.to]),)
    if d.source is not Tier.GPU or not profile.drops_on_demote:
        return ()  # an untyped engine's LRU decides (a CPU-queue program pushed to
        #            Waiting; a ThunderAgent pause, which tells the engine nothing)
    if Capability.OFFLOAD in caps:
        return (Offload(d.program_id, d.replica),)
    if d.to is Tier.NONE and Capability.DROP in caps:
        return (Drop(d.program_id, d.replica),)
    return ()


# -- the decision log --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One executed decision, the policy time it was taken at and, where the log reads
    it, the program's state then (``mori.core.explain``; not part of equality)."""

    time: float
    decision: Decision
    context: DecisionContext | None = field(default=None, compare=False)

    @property
    def kind(self) -> str:
        return type(self.decision).__name__.lower()

    def as_dict(self) -> dict[str, Any]:
        d = self.decision
        source = d.source.value if isinstance(d, (Promote, Demote)) else None
        out: dict[str, Any] = {"time": self.time, "kind": self.kind,
                               "program_id": d.program_id, "replica": d.replica,
                               "source": source, "to": d.to.value if isinstance(d, Demote) else None}
        if self.context is not None or isinstance(d, Release):
            out["reason"] = self.reason
        return out

    @property
    def reason(self) -> str:
        return reason_for(self.decision, self.context)


class DecisionLog:
    """The most recent ``limit`` executed decisions, oldest first (None: all of them).

    ``context``: reads the decided program's state as each decision is logged (see
    ``mori.core.explain.context_reader``), so records can say why; None reads nothing.
    """

    def __init__(self, limit: int | None = None, context: ContextReader | None = None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"a decision log keeps >= 0 records, got {limit}")
        self._records: deque[DecisionRecord] = deque(maxlen=limit)
        self._context = context

    def append(self, time: float, decision: Decision) -> None:
        if self._records.maxlen != 0:
            ctx = self._context(decision, time) if self._context is not None else None
            self._records.append(DecisionRecord(time, decision, ctx))

    def read_context(self, reader: ContextReader | None) -> None:
        """Read the decided program's state with ``reader`` from now on (a world that
        builds its policy after the log passes it in here)."""
        self._context = reader

    def latest(self, n: int) -> list[DecisionRecord]:
        """The ``n`` most recent records, newest first."""
        out: list[DecisionRecord] = []
        for r in reversed(self._records):
            if len(out) >= n:
                break
            out.append(r)
        return out

    def since(self, time: float) -> list[DecisionRecord]:
        return [r for r in self._records if r.time >= time]

    def __iter__(self) -> Iterator[DecisionRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


# -- the executor ------------------------------------------------------------------------
class EngineTarget(Protocol):
    """The engine actions a world can carry out (each world implements all five).

    ``submit`` hands a held request to a replica; the others are KV controls. A world
    whose engines cannot carry out a control never receives it: the executor only emits
    what the replica's capabilities allow.
    """

    def submit(self, program_id: str, replica: int, reload: bool) -> None: ...
    def set_label(self, program_id: str, replica: int, label: KVLabel) -> None: ...
    def offload(self, program_id: str, replica: int) -> None: ...
    def drop(self, program_id: str, replica: int) -> None: ...
    def release(self, program_id: str) -> None: ...


@dataclass(slots=True)
class ExecutionCounts:
    """What the executor carried out: decisions by kind, promotions by the tier the
    program came from, demotions by the tier it went to, engine actions by kind."""

    decisions: Counter[str] = field(default_factory=Counter)
    promotions: Counter[Tier] = field(default_factory=Counter)
    demotions: Counter[Tier] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)


class DecisionExecutor:
    """Carries out decisions on a world's engines, in the order the policy gave them."""

    def __init__(self, profile: EngineProfile,
                 capabilities: Callable[[int], frozenset[Capability]],
                 target: EngineTarget, log: DecisionLog | None = None) -> None:
        """``capabilities(replica)``: the controls a replica offers now (read at every
        decision: an engine may gain or lose a control, e.g. a plug-in that stops
        answering)."""
        self.profile = profile
        self.capabilities = capabilities
        self.target = target
        self.log = log if log is not None else DecisionLog(0)
        self.counts = ExecutionCounts()

    def execute(self, now: float, decisions: Iterable[Decision]) -> None:
        """Carry out one ``decide()`` result, in order."""
        from_cpu: set[str] = set()  # promoted from the CPU tier in this round
        for d in decisions:
            self.log.append(now, d)
            self.counts.decisions[type(d).__name__.lower()] += 1
            if isinstance(d, Promote):
                self.counts.promotions[d.source] += 1
                if d.source is Tier.CPU:
                    from_cpu.add(d.program_id)
            elif isinstance(d, Demote):
                self.counts.demotions[d.to] += 1
            caps = self.capabilities(d.replica) if d.replica is not None else frozenset()
            reload = isinstance(d, Forward) and d.program_id in from_cpu
            for a in engine_actions(d, self.profile, caps, reload):
                self._apply(a)

    def _apply(self, a: EngineAction) -> None:
        self.counts.actions[type(a).__name__] += 1
        t = self.target
        if isinstance(a, Submit):
            t.submit(a.program_id, a.replica, a.reload)
        elif isinstance(a, SetLabel):
            t.set_label(a.program_id, a.replica, a.label)
        elif isinstance(a, Offload):
            t.offload(a.program_id, a.replica)
        elif isinstance(a, Drop):
            t.drop(a.program_id, a.replica)
        else:
            t.release(a.program_id)
