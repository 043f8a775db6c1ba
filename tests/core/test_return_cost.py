"""The default ``mori`` weighs what a move costs (``mori_ranking.ReturnCost``), in
hand-worked scenarios beside the paper's rule (``mori-paper``).

Capacities in tokens (1 byte each); ``recompute_tok_s=10``: a 60-token context takes
6 s to recompute.
"""

from __future__ import annotations

import pytest
from scenario_steps import CPU, GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.policies.mori_ranking import ReturnCost

RATE = {"recompute_tok_s": 10.0}


def test_no_room_to_park_the_working_set_stays_until_a_drop_pays_for_itself() -> None:
    """No CPU tier: A (60 tokens, alone on the GPU) may be dropped only once it has been
    in its tool call as long as its recompute takes the replica: 6 s x 1 program."""
    p = make("mori", gpu=100, cpu=0, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))  # A acts (a tool call) from t = 1
    assert step(p, 2.0, arrive("B", 60)) == []  # B waits: A's drop would cost 6 s
    assert where(p, "A") == (GPU, 0) and where(p, "B") == (NONE, None)
    assert step(p, 6.9) == []
    assert step(p, 7.0) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_the_papers_rule_drops_at_once() -> None:
    p = make("mori-paper", gpu=100, cpu=0, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 2.0, arrive("B", 60)) == [Demote("A", 0, GPU, NONE),
                                             Promote("B", 0, NONE), Forward("B", 0)]


@pytest.mark.parametrize("name", ["mori", "mori-paper"])
def test_room_to_park_it_parks_at_once(name: str) -> None:
    """A reload costs the replica no GPU time: with room in the CPU tier, both park A at
    once for B."""
    p = make(name, gpu=100, cpu=100, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 1.5, arrive("B", 60)) == [Demote("A", 0, GPU, CPU),
                                             Promote("B", 0, NONE), Forward("B", 0)]


def test_the_price_of_a_drop_counts_every_program_on_the_gpu() -> None:
    """Two programs share the GPU: dropping A (60 tokens) costs 6 s for each, 12 s."""
    p = make("mori", gpu=100, cpu=0, **RATE)
    step(p, 0.0, arrive("A", 60), arrive("S", 20))
    step(p, 1.0, fin("A", 60))  # S keeps reasoning
    assert step(p, 2.0, arrive("B", 50)) == []
    assert step(p, 12.9) == []
    assert step(p, 13.0) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                             Forward("B", 0)]


def test_a_drop_is_cheaper_on_a_replica_that_has_been_idle() -> None:
    """A and S both in tool calls from t = 1, the engine idle since: dropping A (6 s of
    recompute) is priced for the two programs on the GPU times the replica's busy share
    (e^-(t-1)/60), never below one. It pays once A has been away 12 e^-x/60 s (x about
    10.1 s), where the price for an always-busy engine (``load_window_s=None``) waits for
    12 s, as with ``load_window_s=0``. (S's drop pays sooner, but its room alone is not
    enough for B.)"""
    for window, at in ((60.0, 11.2), (None, 13.0), (0.0, 13.0)):
        p = make("mori", gpu=100, cpu=0, load_window_s=window, **RATE)
        step(p, 0.0, arrive("A", 60), arrive("S", 20))
        step(p, 1.0, fin("A", 60), fin("S", 20))
        assert step(p, 2.0, arrive("B", 50)) == []
        assert step(p, at - 0.2) == []
        out = step(p, at)
        assert Demote("A", 0, GPU, NONE) in out and out[-2:] == [Promote("B", 0, NONE),
                                                                 Forward("B", 0)]


def _c_parked_a_acting(cpu: int) -> object:
    """C (60) parked in the CPU tier, in a tool call since t = 1; A (60) on the GPU, in
    a tool call since t = 2; B (60) arrives at t = 3: A can park only if C goes."""
    p = make("mori", gpu=100, cpu=cpu, **RATE)
    step(p, 0.0, arrive("C", 60))
    step(p, 1.0, fin("C", 60))
    step(p, 1.0, arrive("A", 60))  # C parks for A (free room)
    assert where(p, "C") == (CPU, 0)
    step(p, 2.0, fin("A", 60))
    assert step(p, 3.0, arrive("B", 60)) == []
    return p


def test_a_large_cpu_tier_is_made_room_in_by_drops_that_pay() -> None:
    """CPU tier as large as the GPU's: A parks once C's drop pays (C away 6 s x the one
    program on the GPU: t = 7), though A's own drop would not yet."""
    p = _c_parked_a_acting(cpu=100)
    assert step(p, 6.9) == []  # type: ignore[arg-type]
    assert step(p, 7.0) == [Demote("C", 0, CPU, NONE), Demote("A", 0, GPU, CPU),  # type: ignore[arg-type]
                            Promote("B", 0, NONE), Forward("B", 0)]


def test_a_small_cpu_tier_is_made_room_in_only_when_the_parked_ones_drop_pays() -> None:
    """CPU tier smaller than the GPU's: pushing C out to park A would churn it; A leaves
    only once its own drop pays (t = 2 + 6), and then parks by the paper's push-out."""
    p = _c_parked_a_acting(cpu=60)
    assert step(p, 7.0) == [] and step(p, 7.9) == []  # type: ignore[arg-type]
    assert step(p, 8.0) == [Demote("C", 0, CPU, NONE), Demote("A", 0, GPU, CPU),  # type: ignore[arg-type]
                            Promote("B", 0, NONE), Forward("B", 0)]


def test_a_program_that_never_ran_here_may_always_leave() -> None:
    p = make("mori", gpu=100, cpu=0, **RATE)
    assert isinstance(p.ranking, ReturnCost)  # type: ignore[attr-defined]
    step(p, 0.0, arrive("A", 60))
    a = p.programs["A"]
    assert ReturnCost.away_s(a, 0.0) == float("inf")


def test_no_link_no_parking() -> None:
    """A reload bandwidth of 0 GB/s: a reload is priced as never ending, so nobody
    leaves at once to park; a move waits until the drop's price is paid (and then the
    program still goes to the free CPU tier, whose KV costs nothing to keep). Nothing
    divides by zero."""
    p = make("mori", gpu=100, cpu=100, reload_gbps=0.0, **RATE)
    step(p, 0.0, arrive("A", 60))
    assert p.reload_s(p.programs["A"]) == float("inf")
    step(p, 1.0, fin("A", 60))
    assert step(p, 2.0, arrive("B", 60)) == []  # no parking: A stays until its drop pays
    assert step(p, 6.9) == []
    assert step(p, 7.0) == [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_a_held_request_says_why_it_waits() -> None:
    """B waits for A's drop to pay (t = 7); the reason says how much room and when."""
    p = make("mori", gpu=100, cpu=0, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    step(p, 2.0, arrive("B", 60))
    why = p.hold_reason("B", 2.0)
    assert why is not None and "replica 0 needs 20 tokens" in why
    assert "in 5.0 s, when A's leaving pays" in why
    assert p.hold_reason("A", 2.0) is None  # A holds no request
    assert p.hold_reason("nobody", 2.0) is None
    assert "now" in (p.hold_reason("B", 7.5) or "")  # before the round that places it
    step(p, 7.5)
    assert p.hold_reason("B", 7.5) is None  # forwarded: nothing held


def test_a_policy_without_reasons_gives_none() -> None:
    p = make("smg", gpu=100, cpu=0)
    step(p, 0.0, arrive("A", 60))
    assert p.hold_reason("A", 0.0) is None


def test_a_ranking_that_forbids_the_move_never_promises_room() -> None:
    """``mori-strict``: A may leave only for a program less idle than itself; B, new,
    has idleness 0 like A, so A never leaves for it: the reason names no time."""
    p = make("mori-strict", gpu=100, cpu=0)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    step(p, 1.0, arrive("B", 60))
    why = p.hold_reason("B", 1.0) or ""
    assert "inf" not in why and "waits for running steps" in why
