"""The GPU tier overcommitted (``PolicyConfig.gpu_overcommit``): a policy with typed
eviction fills a GPU tier X times the engine's pool, so a program whose KV does not fit
the pool beside an Acting one goes at once and the Acting one keeps its place (the
engine evicts its cached KV in label order if it needs the room); an untyped policy's
tiers are the engine's.

Capacities in tokens (1 byte each); ``recompute_tok_s=10``: a 60-token context takes
6 s to recompute, an 80-token one 8 s.
"""

from __future__ import annotations

import math

import pytest
from scenario_steps import GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.ledger import ClusterSpec
from mori.core.policies import MoriPolicy
from mori.core.policies.mori_overcommit import Overcommit
from mori.core.policy import EngineProfile, PolicyConfig

RATE = {"recompute_tok_s": 10.0}


@pytest.mark.parametrize("x", [0.5, 0.0, -1.0, math.inf, math.nan])
def test_an_overcommit_below_one_or_not_finite_is_refused(x: float) -> None:
    with pytest.raises(ValueError, match="gpu_overcommit"):
        PolicyConfig(gpu_overcommit=x)


def test_the_gpu_tier_is_the_pool_times_x_and_the_cpu_tier_the_same() -> None:
    p = make("mori", gpu=100, cpu=80, gpu_overcommit=2.5)
    assert p.placement.gpu[0].capacity == 250 and p.placement.cpu[0].capacity == 80


class UntypedMori(MoriPolicy):
    """MORI's rules over an engine that evicts by its own LRU."""

    engine_profile = EngineProfile(cpu_tier=True, typed_eviction=False)


def test_a_policy_without_typed_eviction_keeps_the_engines_pool() -> None:
    p = UntypedMori(ClusterSpec(1, 100, 80), 1, PolicyConfig(page_tokens=1,
                                                             gpu_overcommit=3.0))
    assert p.placement.gpu[0].capacity == 100


def test_without_overcommit_the_newcomer_waits_for_the_drop_to_pay() -> None:
    """No CPU tier: room for B only by dropping A, whose drop pays at t = 1 + 8."""
    p = make("mori", gpu=100, cpu=0, **RATE)
    step(p, 0.0, arrive("A", 80))
    step(p, 1.0, fin("A", 80))
    assert step(p, 1.5, arrive("B", 80)) == []
    assert step(p, 9.0) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_overcommitted_the_newcomer_goes_at_once_and_the_acting_one_stays() -> None:
    p = make("mori", gpu=100, cpu=0, gpu_overcommit=2.0, **RATE)
    step(p, 0.0, arrive("A", 80))
    step(p, 1.0, fin("A", 80))
    assert step(p, 1.5, arrive("B", 80)) == [Promote("B", 0, NONE), Forward("B", 0)]
    assert where(p, "A") == (GPU, 0) and where(p, "B") == (GPU, 0)
    # the overcommitted tier binds as the pool did: a third waits for a drop that pays
    step(p, 2.0, fin("B", 80))
    assert step(p, 2.5, arrive("C", 80)) == []
    assert where(p, "C") == (NONE, None)


# -- the tier that follows the engine (gpu_overcommit_max, mori_overcommit) --------------
# a load window of 1 s: the rule looks once a second; the busy share starts at 1 (a
# replica nobody used reads busy) and decays with a 1 s time constant, as do the
# pressure shares


def adaptive(**cfg: object) -> tuple[MoriPolicy, Overcommit]:
    p = make("mori", gpu=100, cpu=0, gpu_overcommit_max=4.0, load_window_s=1.0,
             **RATE, **cfg)
    assert isinstance(p, MoriPolicy) and p.overcommit is not None
    return p, p.overcommit


def b_held_while_s_runs(p: MoriPolicy) -> None:
    """A (60 tokens) acts, S (20) keeps reasoning, B (60) is held from t = 1.5."""
    step(p, 0.0, arrive("A", 60), arrive("S", 20))
    step(p, 1.0, fin("A", 60))
    step(p, 1.5, arrive("B", 60))


def test_held_on_an_idle_engine_the_tier_grows_until_the_request_goes() -> None:
    """A (80 tokens) acts; B (80) is held: A's drop pays only at t = 9. The engine stands
    idle, so the tier grows by half once a second after the busy share is below 0.8,
    and B goes beside A when it is 2.25 pools."""
    p, oc = adaptive()
    step(p, 0.0, arrive("A", 80))
    step(p, 1.0, fin("A", 80))
    assert step(p, 1.5, arrive("B", 80)) == [] and oc.x == 1.0  # looked at t = 1
    assert step(p, 3.0) == [] and oc.x == 1.5  # 150 tokens: B does not fit beside A
    assert step(p, 4.0) == [Promote("B", 0, NONE), Forward("B", 0)]
    assert oc.x == 2.25 and p.placement.gpu[0].capacity == 225
    assert where(p, "A") == (GPU, 0)
    # nothing held now: the tier stays where it is
    step(p, 5.0, fin("B", 80))
    step(p, 7.0)
    assert oc.x == 2.25


def test_a_busy_engine_never_grows_the_tier() -> None:
    """S reasons all along (the busy share stays 1): B is held as with a fixed tier."""
    p, oc = adaptive()
    b_held_while_s_runs(p)
    for t in range(2, 8):
        assert step(p, float(t)) == []
    assert oc.x == 1.0 and p.placement.gpu[0].capacity == 100


def test_requests_in_flight_beyond_the_pool_halve_the_tier() -> None:
    """The tier grew to 2.25 pools for B; then A, B and C reason at once (220 tokens in
    flight against the pool's 100) for long enough: the tier halves, though not below
    what runs (220) until those steps end."""
    p, oc = adaptive()
    step(p, 0.0, arrive("A", 80))
    step(p, 1.0, fin("A", 80))
    step(p, 1.5, arrive("B", 80))
    step(p, 3.0)
    step(p, 4.0)
    assert oc.x == 2.25
    step(p, 4.2, arrive("A", 80), arrive("C", 60))  # C fits: 80 + 80 + 60 <= 225
    assert where(p, "C") == (GPU, 0)
    cap = p.placement.gpu[0].capacity
    step(p, 8.0)  # in flight 220 > 100 since 4.2: the overrun share is 0.98
    assert oc.x == 1.125 and p.placement.gpu[0].capacity == 220 < cap
    # the steps end: the tier comes down to its size at once, the Acting programs
    # beyond it leaving (no CPU tier: dropped), the most idle first
    out = step(p, 8.5, fin("A", 80), fin("B", 80), fin("C", 60))
    assert p.placement.gpu[0].capacity == 112 and p.placement.gpu[0].used <= 112
    assert out and all(isinstance(d, Demote) and d.to is NONE for d in out)
    step(p, 9.5)  # the overrun share is down to 0.36: it stays
    assert oc.x == 1.125 and p.placement.gpu[0].capacity == 112


def test_where_the_engine_is_read_its_queue_decides() -> None:
    """The gateway reads the engine: its running count is the busy share (an engine that
    reports nothing running is idle, whatever the policy forwarded), its queue says
    when the tier runs ahead of it. S's step stays on the policy's books all along (as a
    gateway counts a request streaming back), but the engine reports it idle: the tier
    grows for B; then the engine's queue stays full: it halves."""
    p, oc = adaptive()
    b_held_while_s_runs(p)
    for t in (2.0, 3.0, 4.0, 5.0):
        p.set_engine_queues([0], t, running=[0])
        step(p, t)
    assert where(p, "B") == (GPU, 0) and oc.x > 1.0
    grown = oc.x
    for t in (6.0, 7.0, 8.0, 9.0, 10.0):
        p.set_engine_queues([4], t, running=[1])
        step(p, t)
    assert oc.x < grown
