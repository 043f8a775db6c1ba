"""What the dashboard shows at one instant, read from a policy (either world).

``take_snapshot`` reads the policy's program table and tier ledgers (the same objects
the simulator and the gateway drive) and the decision log. Pure: time is passed in, and
nothing is changed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mori.core.decision_log import DecisionRecord
from mori.core.decisions import Demote, Promote
from mori.core.policy import Policy
from mori.core.types import Status, Tier


@dataclass(frozen=True, slots=True)
class ProgramRow:
    """One program. ``since_request_s``: seconds since its latest request arrived.
    ``agent``: its agent kind and ``tools`` the tools it called, most used first (the
    gateway knows them from the wire; empty in the simulator)."""

    program_id: str
    idleness: float
    status: Status
    tier: Tier
    replica: int | None
    context_tokens: int
    since_request_s: float | None
    steps: int
    agent: str = ""
    tools: str = ""


@dataclass(frozen=True, slots=True)
class TierRow:
    """One replica's tiers: tokens placed by the policy against capacity."""

    replica: int
    gpu_tokens: int
    gpu_capacity: int
    cpu_tokens: int
    cpu_capacity: int
    gpu_programs: int
    cpu_programs: int

    @property
    def gpu_frac(self) -> float:
        return self.gpu_tokens / self.gpu_capacity if self.gpu_capacity else 0.0

    @property
    def cpu_frac(self) -> float:
        return self.cpu_tokens / self.cpu_capacity if self.cpu_capacity else 0.0


@dataclass(frozen=True, slots=True)
class HeldRow:
    """A held request, in the order the policy considers them."""

    program_id: str
    waited_s: float
    tier: Tier
    replica: int | None
    context_tokens: int


@dataclass(frozen=True, slots=True)
class DecisionRow:
    time: float
    kind: str  # forward, promote, demote (to the CPU tier), drop (to none), release
    program_id: str
    replica: int | None
    move: str  # e.g. "cpu → gpu"; empty for forwards and releases
    reason: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Programs ranked by idleness (busiest first), tiers per replica, the held requests
    (oldest first) and the latest decisions (newest first)."""

    time: float
    policy: str
    programs: tuple[ProgramRow, ...]
    tiers: tuple[TierRow, ...]
    held: tuple[HeldRow, ...]
    decisions: tuple[DecisionRow, ...]

    def count(self, status: Status | None = None, tier: Tier | None = None) -> int:
        return sum(1 for p in self.programs
                   if (status is None or p.status is status) and (tier is None or p.tier is tier))


def take_snapshot(policy: Policy, now: float, decisions: Sequence[DecisionRecord] = (),
                  time_scale: float = 1.0,
                  agents: Mapping[str, tuple[str, str]] | None = None) -> Snapshot:
    """The state of ``policy`` at policy time ``now``.

    ``decisions``: the records to show, newest first. ``time_scale``: policy seconds per
    second shown (the gateway's ``--time-scale``; durations are divided by it).
    ``agents``: program id -> (agent kind, tools), where known.
    """
    rows = []
    known = agents or {}
    for p in policy.programs.values():
        last = p.history[-1].arrived if p.history else None
        since = (now - last) / time_scale if last is not None else None
        agent, tools = known.get(p.program_id, ("", ""))
        rows.append(ProgramRow(p.program_id, p.idleness(now), p.status, p.tier, p.replica,
                               p.tokens, since, p.steps_done, agent, tools))
    rows.sort(key=lambda r: (r.idleness, r.program_id))
    held = tuple(
        HeldRow(p.program_id,
                (now - p.history[-1].arrived) / time_scale if p.history else 0.0,
                p.tier, p.replica, p.tokens)
        for p in sorted(policy.ready_programs, key=lambda p: p.ready_seq))
    return Snapshot(now, policy.name, tuple(rows), tier_rows(policy), held,
                    tuple(decision_row(r) for r in decisions))


def tier_rows(policy: Policy) -> tuple[TierRow, ...]:
    """Each replica's tiers as the policy's ledger holds them (cheap: no program scan)."""
    kvb = policy.kv_bytes_per_token
    place = policy.placement
    return tuple(
        TierRow(r, int(g.used) // kvb, int(g.capacity or 0) // kvb,
                int(c.used) // kvb, int(c.capacity or 0) // kvb, len(g.members), len(c.members))
        for r, (g, c) in enumerate(zip(place.gpu, place.cpu, strict=True)))


def decision_row(r: DecisionRecord) -> DecisionRow:
    """The record as shown: a demotion to no tier is called a drop (its KV is not kept)."""
    d = r.decision
    kind, move = r.kind, ""
    if isinstance(d, Promote):
        move = f"{d.source.value} → gpu"
    elif isinstance(d, Demote):
        move = f"{d.source.value} → {d.to.value}"
        if d.to is Tier.NONE:
            kind = "drop"
    return DecisionRow(r.time, kind, d.program_id, d.replica, move, r.reason)
