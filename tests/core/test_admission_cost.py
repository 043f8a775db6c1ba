"""A new program's admission looks at a bounded number of programs, however many are held.

A gateway holds thousands of programs that sit idle (parked on a CPU tier, or on no
tier) while a few use the GPU. Admitting a new program (its ``RequestArrived`` and the
round that follows) must cost what the GPU and the candidates that move cost, not what
the idle programs do: the indexes of ``mori_book`` keep it so. Counted here without
timing: the idleness computations of one admission (every ranking of programs computes
them, so a scan of a tier's members would show as one per member) are the same with
100 and with 1,500 programs held.
"""

from __future__ import annotations

import pytest

from mori.core.decisions import Forward
from mori.core.events import ProgramEnded, RequestArrived, StepFinished
from mori.core.idleness import IdlenessTracker
from mori.core.ledger import ClusterSpec
from mori.core.policies import build_policy
from mori.core.policy import Policy, PolicyConfig

TOKENS = 1000  # every program's context
GPU_PROGRAMS = 10  # what a GPU tier holds


class Counted:
    """Counts ``IdlenessTracker.idleness`` calls while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = IdlenessTracker.idleness

        def idleness(tracker: IdlenessTracker, now: float) -> float:
            self.calls += 1
            return real(tracker, now)

        monkeypatch.setattr(IdlenessTracker, "idleness", idleness)


def admit(policy: Policy, pid: str, now: float) -> list[str]:
    """A request of ``pid`` arrives; the programs the round forwards."""
    policy.observe(RequestArrived(pid, TOKENS), now)
    return [d.program_id for d in policy.decide(now) if isinstance(d, Forward)]


def held_programs(policy: Policy, n: int, gap: float) -> float:
    """``n`` programs, one step each, left Acting (in a tool call that never ends);
    the time after the last."""
    t = 0.0
    for i in range(n):
        t += gap
        forwarded = admit(policy, f"held-{i}", t)
        t += gap
        for pid in forwarded:
            policy.observe(StepFinished(pid, TOKENS), t)
        policy.decide(t)
    return t


def admission_costs(name: str, held: int, cpu_programs: int, replicas: int, gap: float,
                    idle_s: float, counted: Counted) -> list[int]:
    """The idleness computations of each of 20 new programs' admissions, with ``held``
    programs held, idle for ``idle_s`` since the last one's step (each new one's step
    ends, and it is released, before the next)."""
    cluster = ClusterSpec(replicas, GPU_PROGRAMS * TOKENS, cpu_programs * TOKENS)
    policy = build_policy(name, cluster, 1, PolicyConfig(page_tokens=1,
                                                         recompute_tok_s=20_000.0))
    t = held_programs(policy, held, gap) + idle_s  # the held programs sit in their tool calls
    costs = []
    for k in range(20):
        t += gap
        before = counted.calls
        forwarded = admit(policy, f"new-{k}", t)
        costs.append(counted.calls - before)
        t += gap
        for pid in forwarded:
            policy.observe(StepFinished(pid, TOKENS), t)
        policy.observe(ProgramEnded(f"new-{k}"), t)
        policy.decide(t)
    policy.check_integrity()
    assert len(policy.programs) == held
    return costs


@pytest.mark.parametrize("name", ["mori", "mori-strict", "mori-ski", "mori-pack"])
@pytest.mark.parametrize(("cpu_programs", "replicas", "gap", "idle_s"), [
    (5, 1, 1.0, 0.0),  # a small CPU tier: the held programs are on no tier
    (5, 1, 0.001, 0.0),  # their drops do not pay yet: new programs wait in Uncached
    (400, 1, 0.001, 60.0),  # a CPU tier full of parked programs
    (400, 2, 1.0, 60.0),  # two replicas
])
def test_a_new_programs_admission_does_not_look_at_the_idle_programs(
        name: str, cpu_programs: int, replicas: int, gap: float, idle_s: float,
        monkeypatch: pytest.MonkeyPatch) -> None:
    counted = Counted(monkeypatch)
    few = admission_costs(name, 100, min(cpu_programs, 50), replicas, gap, idle_s, counted)
    many = admission_costs(name, 1500, cpu_programs, replicas, gap, idle_s, counted)
    # the GPU's programs, and a few more: never one per program held
    bound = 2 * GPU_PROGRAMS * replicas + 4
    assert max(few) <= bound and max(many) <= bound, (few, many)
    assert max(many) <= max(few) + 2, (few, many)
