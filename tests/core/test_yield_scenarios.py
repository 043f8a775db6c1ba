"""``mori-yield``: a CPU-queue program's affinity yields, in hand-worked scenarios, and
on one replica the variant is the paper's MORI."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from scenario_steps import arrive, fin, make, step, where
from test_differential import crowded, trace

from mori.core.decisions import Demote, Forward, Promote
from mori.core.policies import MoriPaperPolicy, MoriYieldPolicy
from mori.core.types import Tier

GPU, CPU, NONE = Tier.GPU, Tier.CPU, Tier.NONE
# 1 byte a token; reloads at 30 bytes/s, recomputes at 10 tokens/s: A's 45 tokens take
# 1.5 s to reload and 4.5 s to recompute, so A may move after waiting 3 s
RATES = dict(reload_gbps=3e-8, recompute_tok_s=10.0)


def _a_on_cpu_behind_c(name: str) -> object:
    """Two replicas of 100. A and B run on replicas 0 and 1; C (70) takes replica 0,
    A going to its CPU tier; at t = 3 A returns (45) while C's step runs."""
    p = make(name, gpu=100, cpu=100, replicas=2, **RATES)
    step(p, 0.0, arrive("A", 40), arrive("B", 40))
    step(p, 1.0, fin("A", 40), fin("B", 40))
    assert step(p, 2.0, arrive("C", 70)) == [Demote("A", 0, GPU, CPU),
                                             Promote("C", 0, NONE), Forward("C", 0)]
    assert step(p, 3.0, arrive("A", 45)) == []  # home: 100 - 70 running < 45
    return p


def test_affinity_yields_once_the_wait_has_cost_a_recompute_beyond_a_reload() -> None:
    plain, yielding = _a_on_cpu_behind_c("mori-paper"), _a_on_cpu_behind_c("mori-yield")
    assert yielding.rebalancer.after_s(yielding.programs["A"]) == pytest.approx(3.0)  # type: ignore[attr-defined]
    for t in (4.0, 5.9):
        assert step(yielding, t) == []
    # t = 6: A has waited 3 s; replica 1 has 60 free beside B (Acting): A drops its CPU
    # copy and is recomputed there
    assert step(yielding, 6.0) == [Demote("A", 0, CPU, NONE), Promote("A", 1, NONE),
                                   Forward("A", 1)]
    assert where(yielding, "A") == (GPU, 1)
    # MORI keeps A for its own replica as long as C runs
    for t in (6.0, 30.0):
        assert step(plain, t) == []
    assert where(plain, "A") == (CPU, 0)


def test_no_yield_when_home_frees_up_first() -> None:
    p = _a_on_cpu_behind_c("mori-yield")
    # C's step ends at t = 4, before A's 3 s are up: A reloads at home, C (Acting) goes
    out = step(p, 4.0, fin("C", 70))
    assert Promote("A", 0, CPU) in out and Forward("A", 0) in out
    assert step(p, 10.0) == []
    assert where(p, "A") == (GPU, 0)


@pytest.mark.parametrize("b_returns", [True, False])
def test_no_yield_onto_a_replica_whose_own_cpu_program_waits(b_returns: bool) -> None:
    p = make("mori-yield", gpu=100, cpu=100, replicas=2, **RATES)
    step(p, 0.0, arrive("A", 40), arrive("B", 50))  # B onto replica 0, A onto 1
    step(p, 1.0, fin("A", 40), fin("B", 50))
    step(p, 2.0, arrive("C", 70))  # A to replica 1's CPU tier for C
    step(p, 2.5, arrive("D", 55))  # B to replica 0's CPU tier for D: 45 free there
    assert (where(p, "A"), where(p, "B")) == ((CPU, 1), (CPU, 0))
    # A returns (45, fits replica 0's free 45); B perhaps too (50: it does not fit)
    returns = [arrive("A", 45)] + ([arrive("B", 50)] if b_returns else [])
    assert step(p, 3.0, *returns) == []
    if b_returns:  # replica 0's room is for B, its own CPU-queue program: A stays
        assert step(p, 6.0) == [] and step(p, 10.0) == []
        assert where(p, "A") == (CPU, 1)
    else:
        assert step(p, 6.0) == [Demote("A", 1, CPU, NONE), Promote("A", 0, NONE),
                                Forward("A", 0)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=crowded())
def test_on_one_replica_it_is_mori_paper(w: dict[str, object]) -> None:
    w = {**w, "replicas": 1,
         "config": dataclasses.replace(w["config"], recompute_tok_s=1.0)}  # type: ignore[type-var]
    assert trace(MoriYieldPolicy, w) == trace(MoriPaperPolicy, w)
