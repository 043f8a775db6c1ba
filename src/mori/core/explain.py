"""Why a decision was taken, in words: for the decision log and the dashboard.

A policy's decisions are bare data (``mori.core.decisions``). What made the policy take
one is the program's state at that instant: its status, its idleness and its context.
``DecisionContext`` keeps exactly that, read from the policy when the decision is logged
(``context_reader``), and ``reason`` says it in one line. Pure: no I/O, time passed in.

The words describe the rule the decision follows (docs/system.md, "Placement"): a
promotion brings a ready program's KV onto a GPU (reloaded from the CPU tier, recomputed,
or re-routed), a demotion moves the most idle program off a full tier, a forward sends a
held request to the replica whose GPU tier now holds its KV.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mori.core.decisions import Decision, Demote, Forward, Promote, Release
from mori.core.program import Program
from mori.core.types import Status, Tier


@dataclass(frozen=True, slots=True)
class DecisionContext:
    """The decided program's state when the decision was taken.

    ``waited_s``: policy seconds since its latest request arrived (for a forward: how
    long the request was held). ``away_s``: seconds since its latest step ended (None:
    it has not run one). ``return_s``: for a demotion, what the policy estimates the
    program's return will cost (a reload where it was parked, a recompute where it was
    dropped; None where the policy does not say).
    """

    status: Status
    idleness: float
    context_tokens: int
    waited_s: float
    away_s: float | None = None
    return_s: float | None = None


ContextReader = Callable[[Decision, float], "DecisionContext | None"]

ReturnCostOf = Callable[[Program, Tier, int, float], float]
"""What a program's return will cost, in policy seconds, having left the GPU of the
given replica for the given tier at the given time (``MoriPolicy.return_cost``)."""


def context_reader(programs: Mapping[str, Program],
                   return_cost: ReturnCostOf | None = None) -> ContextReader:
    """A function reading ``DecisionContext`` from a policy's program table (None for a
    program the table no longer holds, e.g. one that ended)."""

    def read(d: Decision, now: float) -> DecisionContext | None:
        p = programs.get(d.program_id)
        if p is None:
            return None
        arrived = p.history[-1].arrived if p.history else now
        last = p.history[-1].finished if p.history else None
        away = max(0.0, now - last) if last is not None else None
        cost = (return_cost(p, d.to, d.replica, now) if return_cost is not None
                and isinstance(d, Demote) and d.source is Tier.GPU else None)
        return DecisionContext(p.status, p.idleness(now), p.tokens, max(0.0, now - arrived),
                               away, cost)

    return read


_SOURCE = {Tier.CPU: "reloads its KV from the CPU tier",
           Tier.DISK: "reads its KV back from the replica's disk tier",
           Tier.NONE: "recomputes its context (no cached KV)",
           Tier.GPU: "re-routed from another replica's GPU (recomputes there)"}


def reason(d: Decision, ctx: DecisionContext | None) -> str:
    """One line saying why ``d`` was taken, from the program's state at that time."""
    if isinstance(d, Release):
        return "the program ended; its KV is inactive everywhere"
    if ctx is None:
        return "the program had already left"
    state = f"idleness {ctx.idleness:.2f}, {ctx.context_tokens:,} tokens"
    if isinstance(d, Forward):
        return (f"its KV is on replica {d.replica}'s GPU tier: the held request goes on "
                f"after {ctx.waited_s:.1f} s ({state})")
    if isinstance(d, Promote):
        return f"a request is ready: onto replica {d.replica}'s GPU; {_SOURCE[d.source]} ({state})"
    assert isinstance(d, Demote)
    where = d.source.value.upper()
    dest = {Tier.CPU: "the CPU tier", Tier.DISK: "the disk tier"}.get(
        d.to, "no tier (its KV may be lost)")
    why = (f"replica {d.replica}'s {where} tier needed room and this program ranks among "
           f"the most idle there: to {dest} ({ctx.status.value}, {state})")
    if ctx.return_s is None:
        return why
    away = "" if ctx.away_s is None else f"away {ctx.away_s:.1f} s; "
    if d.to is Tier.CPU:
        return (f"{why}; {away}its return is a reload, about {ctx.return_s:.2f} s of the "
                f"link, no GPU time")
    if d.to is Tier.DISK:
        return (f"{why}; {away}its return is a read from disk, about {ctx.return_s:.2f} s "
                f"of its own wait, no GPU time")
    return (f"{why}; {away}its return is a recompute, about {ctx.return_s:.1f} s of the "
            f"replica's GPU time for its programs")
