"""Hand-worked policy scenarios: building a policy, stepping it, and where a program is.

Capacities are in tokens (page 1, 1 byte per token). ``step`` checks each decision list
by replay (``driver.checked_decide``) and that a Forward never precedes its Promote.
"""

from __future__ import annotations

from driver import checked_decide

from mori.core.decisions import Decision, Forward, Promote
from mori.core.events import Event, RequestArrived, StepFinished
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES
from mori.core.policy import Policy, PolicyConfig
from mori.core.types import Tier

GPU, CPU, DISK, NONE = Tier.GPU, Tier.CPU, Tier.DISK, Tier.NONE
# the scenarios that every policy plays (test_scenarios.py) use GPUs of ~100 tokens;
# ThunderAgent reserves 100 tokens per program, so its own scenarios
# (test_thunderagent_scenarios.py) use larger ones, and test_thunderagent_crosscheck.py
# checks it against the real scheduler
UNBUFFERED = [n for n in POLICIES.names() if not n.startswith("thunderagent")]


def make(name: str, gpu: int | None = 100, cpu: int | None = 100, replicas: int = 1,
         disk: int = 0, **cfg: object) -> Policy:
    return POLICIES.get(name)(ClusterSpec(replicas, gpu, cpu, disk), 1,
                              PolicyConfig(page_tokens=1, **cfg))  # type: ignore[arg-type]


def check_order(decisions: list[Decision]) -> None:
    """A Forward never precedes the Promote of the same program in one list."""
    promoted_at: dict[str, int] = {}
    for i, d in enumerate(decisions):
        if isinstance(d, Promote):
            promoted_at.setdefault(d.program_id, i)
    for i, d in enumerate(decisions):
        if isinstance(d, Forward) and d.program_id in promoted_at:
            assert promoted_at[d.program_id] < i, decisions


def step(p: Policy, now: float, *events: Event) -> list[Decision]:
    """Observe ``events`` at ``now`` (none: a tick), then decide (checked by replay)."""
    for ev in events:
        p.observe(ev, now)
    out = checked_decide(p, now)
    check_order(out)
    return out


def arrive(pid: str, tokens: int) -> RequestArrived:
    return RequestArrived(pid, tokens)


def fin(pid: str, tokens: int) -> StepFinished:
    return StepFinished(pid, tokens)


def where(p: Policy, pid: str) -> tuple[Tier, int | None]:
    return p.placement.where(pid)
