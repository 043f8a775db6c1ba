"""``mori``'s work conservation (``PolicyConfig.fill_idle``, ``mori_idle_fill``): a
replica with no step running takes a held request at once when the Acting programs in
its way can all park in free CPU room, without waiting out the reload's price; by
drops only once the held request has waited as long as their recomputes will take.

Capacities in tokens (1 byte each); ``recompute_tok_s=10``: a 60-token context takes
6 s to recompute; the engine charges 2 s per reload (``EngineCosts.reload_fixed_s``).
"""

from __future__ import annotations

from scenario_steps import CPU, GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.engine_costs import EngineCosts
from mori.core.policy import Policy

RATE = {"recompute_tok_s": 10.0}
FIXED_RELOAD = EngineCosts(reload_fixed_s=2.0, reload_per_token_s=0.0)


def policy(cpu: int, fill: bool) -> Policy:
    p = make("mori", gpu=100, cpu=cpu, fill_idle=fill, **RATE)
    p.set_engine_costs(0, FIXED_RELOAD)
    return p


def test_an_idle_replica_parks_for_a_held_request_at_once() -> None:
    p = policy(cpu=100, fill=True)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))  # nothing runs on the replica now
    assert step(p, 1.5, arrive("B", 60)) == [Demote("A", 0, GPU, CPU),
                                             Promote("B", 0, NONE), Forward("B", 0)]


def test_without_the_rule_the_park_waits_out_the_reload_price() -> None:
    p = policy(cpu=100, fill=False)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 1.5, arrive("B", 60)) == []
    assert step(p, 3.0) == [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_a_busy_replica_is_not_filled() -> None:
    """S reasons on the replica: it is not idle, so B waits as the ranking says."""
    p = make("mori", gpu=120, cpu=100, fill_idle=True, **RATE)
    p.set_engine_costs(0, FIXED_RELOAD)
    step(p, 0.0, arrive("A", 60), arrive("S", 20))
    step(p, 1.0, fin("A", 60))  # S keeps reasoning
    assert step(p, 1.5, arrive("B", 60)) == []
    assert where(p, "A") == (GPU, 0) and where(p, "B") == (NONE, None)


def test_no_drop_is_made_for_an_idle_replica() -> None:
    """No CPU tier: room only by dropping A, whose drop pays at t = 1 + 6; the idle
    replica waits for it as without the rule."""
    p = policy(cpu=0, fill=True)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 1.5, arrive("B", 60)) == []
    assert step(p, 6.9) == []
    assert step(p, 7.0) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_a_parked_program_comes_back_to_an_idle_replica_at_once() -> None:
    """A, parked for B, returns while nothing runs: B (now in its tool call) parks for it
    at once."""
    p = make("mori", gpu=100, cpu=200, fill_idle=True, **RATE)
    p.set_engine_costs(0, FIXED_RELOAD)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    out = step(p, 1.2, arrive("B", 60))
    assert out[-1] == Forward("B", 0)
    step(p, 2.0, fin("B", 60))
    step(p, 2.1, arrive("A", 60))  # A (parked) returns: B parks for it at once
    assert where(p, "A") == (GPU, 0) and where(p, "B") == (CPU, 0)


def test_a_drop_is_made_once_the_wait_has_paid_for_it() -> None:
    """No CPU tier: B arrives while A reasons and waits. Once the replica is idle, A
    leaves for B when B has waited A's recompute (6 s, at t = 6.5), before A's own drop
    pays (away 6 s, at t = 7)."""
    p = policy(cpu=0, fill=True)
    step(p, 0.0, arrive("A", 60))
    assert step(p, 0.5, arrive("B", 60)) == []
    step(p, 1.0, fin("A", 60))
    assert step(p, 6.4) == []
    assert step(p, 6.5) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                            Forward("B", 0)]
