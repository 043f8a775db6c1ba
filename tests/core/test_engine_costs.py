"""The engine's prices learned from its answers (``mori.core.engine_costs``), and how
``mori`` uses them: a recompute priced per token as measured, a park that waits out the
reload's measured engine time (``ReturnCost.park_pays``).

Capacities in tokens (1 byte each), as in ``test_return_cost``.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scenario_steps import CPU, GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.engine_costs import CostLearner, EngineCosts, Work

RATE = {"recompute_tok_s": 10.0}


def feed(learner: CostLearner, n: int, base: float, per_token: float,
         fixed: float = 0.0, reload_per_token: float = 0.0, reload_share: float = 0.0,
         seed: int = 0) -> None:
    """``n`` stretches of one to three prefills each, timed exactly by the line."""
    rng = random.Random(seed)
    for _ in range(n):
        work = Work(0, 0)
        for _ in range(rng.randint(1, 3)):
            reloaded = rng.random() < reload_share
            cached = rng.randrange(100, 4000) if reloaded else 0
            work = Work(work.requests + 1, work.computed + rng.randrange(0, 2000),
                        work.reloads + reloaded, work.reloaded + cached)
        t = (base * work.requests + per_token * work.computed + fixed * work.reloads
             + reload_per_token * work.reloaded)
        learner.observe(work, t)


def test_the_prices_come_back_from_exact_samples() -> None:
    learner = CostLearner(1e-3, 1e-6, min_samples=16, prior_weight=1e-6)
    feed(learner, 200, base=0.004, per_token=2e-5, fixed=0.015, reload_per_token=1e-6,
         reload_share=0.5)
    c = learner.costs()
    assert c.recompute_per_token_s == pytest.approx(2e-5, rel=1e-3)
    assert c.reload_fixed_s == pytest.approx(0.015, rel=1e-3)
    assert c.reload_per_token_s == pytest.approx(1e-6, rel=1e-2)
    assert learner.view()["base_s"] == pytest.approx(0.004, rel=1e-3)


def test_nothing_is_priced_before_enough_samples() -> None:
    learner = CostLearner(1e-3, 1e-6, min_samples=16)
    feed(learner, 15, base=0.004, per_token=2e-5)
    assert learner.costs() == EngineCosts()
    feed(learner, 1, base=0.004, per_token=2e-5)
    c = learner.costs()
    assert c.recompute_per_token_s is not None and c.reload_fixed_s is None
    assert learner.view()["reload_samples"] == 0


def test_what_was_never_seen_stays_the_priors() -> None:
    """No reload seen: the reload's prices are the priors' (reported once reloads come);
    every request computed the same tokens: the per-token price stays near the prior's
    and the level goes to the base."""
    learner = CostLearner(3e-4, 1e-6, min_samples=4)
    for _ in range(50):
        learner.observe(Work(1, 50), 0.03)
    base, recompute, fixed, per_token = learner.fit()
    assert (fixed, per_token) == (0.0, 1e-6)
    assert base + 50 * recompute == pytest.approx(0.03, rel=0.05)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_bad_samples_are_ignored(bad: float) -> None:
    learner = CostLearner(1e-3, 1e-6, min_samples=1)
    learner.observe(Work(1, 10), bad)
    learner.observe(Work(0, 10), 0.1)
    learner.observe(Work(1, -1), 0.1)
    assert learner.samples == 0 and learner.costs() == EngineCosts()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 10**6), st.integers(0, 8),
                          st.integers(0, 10**6), st.floats(0, 100, allow_nan=False)),
                max_size=80))
def test_prices_are_never_negative(samples: list[tuple[int, int, int, int, float]]) -> None:
    """Whatever the samples (noise, outliers, a faster reload than a resident step), no
    price is negative or not a number."""
    learner = CostLearner(1e-4, 1e-7, min_samples=1)
    for requests, computed, reloads, reloaded, t in samples:
        learner.observe(Work(requests, computed, min(reloads, requests), reloaded), t)
    for v in learner.fit():
        assert math.isfinite(v) and v >= 0


def test_learned_prices_replace_the_configured_rates() -> None:
    p = make("mori", gpu=100, cpu=100, **RATE)
    step(p, 0.0, arrive("A", 60))
    a = p.programs["A"]
    assert p.recompute_s(a) == pytest.approx(6.0)
    p.set_engine_costs(0, EngineCosts(recompute_per_token_s=0.5, reload_fixed_s=2.0,
                                      reload_per_token_s=0.01))
    assert p.recompute_s(a) == pytest.approx(30.0)
    assert p.reload_s(a) == pytest.approx(2.6)
    assert p.reload_engine_s(a) == pytest.approx(2.6)
    with pytest.raises(ValueError, match="no replica 1"):
        p.set_engine_costs(1, EngineCosts())


def test_a_reload_with_a_fixed_price_parks_only_once_it_pays() -> None:
    """The engine charges 2 s per reload whatever its size: A (back in its tool call at
    t = 1) is parked for B only once it has been away 2 s; without a measured price it
    parks at once (``test_return_cost``)."""
    p = make("mori", gpu=100, cpu=100, **RATE)
    p.set_engine_costs(0, EngineCosts(reload_fixed_s=2.0, reload_per_token_s=0.0))
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 1.5, arrive("B", 60)) == []
    assert where(p, "A") == (GPU, 0) and where(p, "B") == (NONE, None)
    why = p.hold_reason("B", 2.0)
    assert why is not None and "in 1.0 s, when A's leaving pays" in why
    assert step(p, 2.9) == []
    assert step(p, 3.0) == [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_a_drop_that_pays_first_goes_first() -> None:
    """A park's fixed price above the drop's: no CPU tier in the way, the drop pays at
    t = 1 + 6 whatever the reload would cost."""
    p = make("mori", gpu=100, cpu=100, **RATE)
    p.set_engine_costs(0, EngineCosts(reload_fixed_s=50.0, reload_per_token_s=0.0))
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 2.0, arrive("B", 60)) == []
    assert step(p, 6.9) == []
    assert step(p, 7.0) == [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_a_parks_price_counts_the_programs_its_reload_delays() -> None:
    """S keeps reasoning beside A: the reload's 2 s of engine time delays both, so A
    parks for B only once it has been away 4 s (t = 1 + 4), as a drop's recompute is
    priced (``ReturnCost.delayed``)."""
    p = make("mori", gpu=120, cpu=100, **RATE)
    p.set_engine_costs(0, EngineCosts(reload_fixed_s=2.0, reload_per_token_s=0.0))
    step(p, 0.0, arrive("A", 60), arrive("S", 20))
    step(p, 1.0, fin("A", 60))
    assert step(p, 1.5, arrive("B", 60)) == []
    assert step(p, 4.9) == []
    assert step(p, 5.0) == [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_a_park_waits_while_the_engine_queues() -> None:
    """The same 2 s reload, but the engine reports requests waiting from t = 0: A's room
    keeps nobody from work while the engine's own queue is full, so A stays past t = 3
    (``ReturnCost.unqueued``); once the engine reports no queue, A's 3 s away pay for its
    park at once. (A window of 1 ms makes the shares follow the readings.)"""
    p = make("mori", gpu=100, cpu=100, load_window_s=0.001, **RATE)
    p.set_engine_costs(0, EngineCosts(reload_fixed_s=2.0, reload_per_token_s=0.0))
    p.set_engine_queues([2], 0.0)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 1.5, arrive("B", 60)) == []
    assert step(p, 3.0) == [] and step(p, 10.0) == []
    assert where(p, "A") == (GPU, 0) and where(p, "B") == (NONE, None)
    p.set_engine_queues([0], 10.0)
    assert step(p, 10.1) == [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE),
                             Forward("B", 0)]


def test_a_drop_waits_while_the_engine_queues() -> None:
    """No CPU tier: A's drop costs its 6 s recompute; with the engine queued half the time
    since, it pays only after 12 s away, not 6 (a window of 1 ms: the readings below
    alternate every 1 s, so the queue share reads 0 or 1 as they say)."""
    p = make("mori", gpu=100, cpu=0, load_window_s=0.001, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    p.set_engine_queues([1], 1.0)
    assert step(p, 2.0, arrive("B", 60)) == []
    assert step(p, 7.5) == []  # 6.5 s away, queued: price inf
    p.set_engine_queues([None], 7.5)  # no reading: no queue known
    assert step(p, 7.6) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_engine_readings_are_checked() -> None:
    p = make("mori", gpu=100, cpu=100, replicas=2)
    with pytest.raises(ValueError, match="2 replicas"):
        p.set_engine_queues([0], 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        p.set_engine_queues([0, -1], 0.0)
    with pytest.raises(ValueError, match="2 replicas"):
        p.set_engine_queues([0, 0], 0.0, running=[1])
    with pytest.raises(ValueError, match=">= 0"):
        p.set_engine_queues([0, 0], 0.0, running=[1, -2])


def test_the_engines_running_count_is_its_busy_share() -> None:
    """Read, the engine's running count makes the busy share ``mori_overcommit`` reads;
    unread, the policy's own count of the steps it forwarded stands in."""
    p = make("mori", gpu=100, cpu=100, replicas=2, load_window_s=10.0)
    step(p, 0.0, arrive("A", 50))  # A's step runs on a replica from t = 0
    r = p.programs["A"].replica
    assert r is not None
    assert p.load.engine_busy_share(r, 10.0) == p.load.share(r, 10.0) == 1.0
    p.set_engine_queues([0, 0], 0.0, running=[0, 0])  # the engines say: nothing runs
    assert p.load.engine_busy_share(r, 10.0) == pytest.approx(math.exp(-1.0))
    assert p.load.share(r, 10.0) == 1.0
