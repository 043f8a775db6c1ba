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
``Demote`` to DISK     typed engine with ``LABELS``: label it cold (the engine keeps it
                       on its disk tier); otherwise as to CPU
``Demote`` to NONE     typed engine with ``LABELS``: label it inactive; otherwise,
                       leaving the GPU: ``Offload`` (engine with ``OFFLOAD``: the host
                       tier keeps it if there is one) or else ``Drop`` (with ``DROP``);
                       nothing where the profile's ``drops_on_demote`` is off
``Release``            ``ReleaseKV`` on every replica (its KV is inactive)
=====================  =============================================================

An ``EngineTarget`` is what a world offers the executor: the simulator calls its engine
replicas directly, the gateway schedules the adapters' controls in order per replica.
``DecisionExecutor`` applies the actions to a target, counts what it executed and
appends each decision to the ``DecisionLog`` (``mori.core.decision_log``) it is given.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from mori.core.decision_log import DecisionLog
from mori.core.decisions import Decision, Demote, Forward, Promote, Release
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

_DEMOTE_LABEL = {Tier.CPU: KVLabel.IDLE, Tier.DISK: KVLabel.COLD, Tier.NONE: KVLabel.INACTIVE}


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
        #            Uncached; a ThunderAgent pause, which tells the engine nothing)
    if Capability.OFFLOAD in caps:
        return (Offload(d.program_id, d.replica),)
    if d.to is Tier.NONE and Capability.DROP in caps:
        return (Drop(d.program_id, d.replica),)
    return ()


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
