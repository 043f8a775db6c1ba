"""Bounded waiting (``PolicyConfig.max_wait_s``): a request held that long goes ahead
of every other promotion. A hand-worked starvation scenario with its exact decisions,
and a hypothesis test of the bound over random worlds."""

from __future__ import annotations

import dataclasses

import pytest
from driver import FakeWorld
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scenario_steps import arrive, fin, make, step, where
from test_differential import crowded
from test_properties import time_limit, worlds

from mori.core.decisions import Decision, Demote, Forward, Promote
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES, MoriPolicy
from mori.core.policy import Policy, PolicyConfig
from mori.core.types import Status, Tier

GPU, CPU, NONE = Tier.GPU, Tier.CPU, Tier.NONE
MORI_NAMES = [n for n in POLICIES.names() if issubclass(POLICIES.get(n), MoriPolicy)]


def _alternate(p: Policy, until: float) -> list[list[Decision]]:
    """A and C (60 tokens each) take turns on a 100-token GPU, each step 2 s with a 0.5 s
    tool call, the one whose request waits on the CPU always first (MORI's level 0);
    W (50 tokens, new) arrives at t = 2 and never fits beside either. The decisions of
    every round from t = 3 on, one list a round."""
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, arrive("C", 60))
    assert step(p, 1.0, fin("A", 60)) == [Demote("A", 0, GPU, CPU), Promote("C", 0, NONE),
                                          Forward("C", 0)]
    step(p, 1.5, arrive("A", 60))
    step(p, 2.0, arrive("W", 50))
    rounds = []
    turn, t = ["C", "A"], 3.0
    while t <= until:
        done = turn[0]
        rounds.append(step(p, t, fin(done, 60)))
        if where(p, done) == (CPU, 0):  # it was demoted: its next request waits there
            step(p, t + 0.5, arrive(done, 60))
        turn.reverse()
        t += 2.0
    return rounds


def test_without_a_bound_the_waiting_program_starves() -> None:
    p = make("mori-paper", gpu=100, cpu=200, max_wait_s=None)
    rounds = _alternate(p, 41.0)
    # every round: the finished one to the CPU, the other back from it; W never placed
    for r in rounds:
        assert [type(d) for d in r] == [Demote, Promote, Forward]
        assert r[1].program_id != "W"
    assert p.programs["W"].status is Status.HELD and where(p, "W") == (NONE, None)


def test_a_request_past_the_bound_goes_first() -> None:
    p = make("mori-paper", gpu=100, cpu=200, max_wait_s=10.0)
    rounds = _alternate(p, 11.0)
    assert rounds[-1] == [Demote("C", 0, GPU, CPU), Promote("A", 0, CPU), Forward("A", 0)]
    # t = 12: W has waited 10 s, A is reasoning (60 of 100): W cannot fit until A's step
    # ends, and nobody is promoted ahead of it (C's request, sent at 11.5, waits on the CPU)
    assert p.programs["C"].status is Status.HELD
    assert step(p, 12.0) == []
    # t = 13: A's step ends; it makes room for W, and C keeps waiting
    assert step(p, 13.0, fin("A", 60)) == [Demote("A", 0, GPU, CPU), Promote("W", 0, NONE),
                                           Forward("W", 0)]
    assert p.programs["C"].status is Status.HELD and where(p, "C") == (CPU, 0)


def test_the_bound_is_checked() -> None:
    with pytest.raises(ValueError, match="max_wait_s"):
        PolicyConfig(max_wait_s=-1.0)
    with pytest.raises(ValueError, match="max_wait_s"):
        PolicyConfig(max_wait_s=float("inf"))
    assert make("mori-paper", max_wait_s=0.0).config.max_wait_s == 0.0  # 0: no bound


# -- the bound over random worlds -----------------------------------------------------------
BOUNDS = st.sampled_from([0.5, 2.0, 10.0, 60.0])


def _reasoning_kv(p: Policy, r: int) -> int:
    return sum(q.kv_bytes for pid in p.placement.gpu[r].members
               if (q := p.programs[pid]).status is Status.REASONING)


def _check_round(p: Policy, now: float, out: list[Decision]) -> None:
    """After a round: the oldest request held ``max_wait_s`` or longer is still held
    only if no replica it may go to (its own for a CPU-queue program) could hold it were
    every program not running a step gone; and then nobody but older requests past the
    bound was promoted onto the replica it waits for."""
    bound = p.config.max_wait_s
    assert bound
    cutoff = now - bound
    aged = [q for q in p.held_since(cutoff) if q.tier is not GPU]
    if not aged:
        return
    oldest = aged[0]
    cap = p.cluster.gpu_bytes
    assert cap is not None
    replicas = ([oldest.replica] if oldest.tier is CPU and oldest.replica is not None
                else range(p.cluster.replicas))
    for r in replicas:
        assert _reasoning_kv(p, r) + oldest.kv_bytes > cap, (
            f"t={now}: {oldest.program_id} held since {oldest.ready_at} fits replica {r}")
    assert isinstance(p, MoriPolicy)
    assert p.aged is not None
    pid, waits_for = p.aged.waiting
    assert pid == oldest.program_id and waits_for in replicas
    for d in out:
        if isinstance(d, Promote) and d.replica == waits_for:
            q = p.programs[d.program_id]
            assert q.ready_at <= cutoff and q.ready_seq < oldest.ready_seq, (
                f"t={now}: {d.program_id} promoted ahead of {oldest.program_id}")


class _Checked(FakeWorld):
    rounds = 0

    def _decide(self) -> None:
        super()._decide()
        last = self.trace[-1][1]
        assert isinstance(last, list)
        _check_round(self.p, self.now, last)
        _Checked.rounds += 1


def _run(name: str, w: dict[str, object], bound: float) -> None:
    programs = w["programs"]
    config = w["config"]
    assert isinstance(programs, list) and isinstance(config, PolicyConfig)
    config = dataclasses.replace(config, max_wait_s=bound)
    policy = POLICIES.get(name)(
        ClusterSpec(int(w["replicas"]), int(w["gpu"]), int(w["cpu"])),  # type: ignore[arg-type]
        int(w["per_token"]), config)  # type: ignore[arg-type]
    _Checked(policy, programs, time_limit(programs, config.tick_s),
             batch=bool(w.get("batch", False))).run()


@pytest.mark.parametrize("name", MORI_NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=crowded(), bound=BOUNDS)
def test_no_request_waits_past_the_bound_while_capacity_allows(
        name: str, w: dict[str, object], bound: float) -> None:
    _run(name, w, bound)


@pytest.mark.parametrize("name", ["mori-paper"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=worlds(), bound=BOUNDS)
def test_the_bound_in_small_worlds(name: str, w: dict[str, object], bound: float) -> None:
    _run(name, w, bound)


@pytest.mark.parametrize("name", ["mori-paper", "smg", "thunderagent"])
def test_the_arrival_order_stays_small(name: str) -> None:
    # every policy keeps the arrival order; forwarded requests must not pile up in it
    p = make(name, gpu=10**9, cpu=0)
    for i in range(300):
        step(p, float(i), arrive(f"p{i}", 10))
        step(p, i + 0.5, fin(f"p{i}", 20))
        assert len(p._arrivals) <= 2 * 1 + 64  # at most one request held at a time
    held = make("mori-paper", gpu=100, cpu=0, max_wait_s=5.0)
    for i in range(300):
        step(held, float(i), arrive(f"p{i}", 60))  # p0 runs; the rest wait for room
    assert [q.program_id for q in held.held_since(100.0)] == [f"p{i}" for i in range(1, 101)]
