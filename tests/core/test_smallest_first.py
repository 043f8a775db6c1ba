"""MORI's own promotion order (``mori_index.priority_smallest_first``): the programs
with nothing cached, returning or new, are admitted smallest context first; the paper's
order (``mori-paper``) admits the returning ones by idleness, whatever their size.

Capacities in tokens (1 byte each): one replica, a GPU tier of 100 and no CPU tier, so
a program that leaves the GPU is dropped and returns with nothing cached. D reasons
throughout and keeps 35 tokens; A (60 tokens) has been busier than B (30 tokens).
"""

from __future__ import annotations

import pytest
from scenario_steps import GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Decision, Forward
from mori.core.policies.mori_index import priority, priority_smallest_first
from mori.core.policy import Policy


def _both_dropped(name: str) -> Policy:
    """A and B both dropped, both held again, the GPU full of D and C; C's step ends."""
    p = make(name, gpu=100, cpu=0)
    step(p, 0.0, arrive("D", 35), arrive("A", 60))
    step(p, 1.8, fin("A", 60))  # A reasoned 1.8 s
    step(p, 2.0, arrive("B", 30))  # A is dropped for B
    step(p, 2.2, fin("B", 30))  # B reasoned 0.2 s
    step(p, 4.0, arrive("C", 65))  # B is dropped for C
    assert where(p, "A") == (NONE, None) and where(p, "B") == (NONE, None)
    assert step(p, 5.0, arrive("A", 60), arrive("B", 30)) == []  # C and D reason
    return p


def _room_made(p: Policy) -> list[Decision]:
    """C's step ends; C is dropped (the paper's rule at once, MORI's once C has been
    away as long as its recompute) and one of A and B fits in its room."""
    return step(p, 6.0, fin("C", 65)) + step(p, 7.0)


def test_mori_admits_the_smaller_program_first() -> None:
    p = _both_dropped("mori")
    out = _room_made(p)
    assert Forward("B", 0) in out and Forward("A", 0) not in out
    assert where(p, "B") == (GPU, 0) and where(p, "A") == (NONE, None)


def test_the_paper_admits_the_busier_program_first() -> None:
    p = _both_dropped("mori-paper")
    out = _room_made(p)
    assert Forward("A", 0) in out and Forward("B", 0) not in out
    assert where(p, "A") == (GPU, 0) and where(p, "B") == (NONE, None)


@pytest.mark.parametrize("returning", [False, True])
def test_the_orders_differ_only_for_programs_with_nothing_cached(returning: bool) -> None:
    """Both orders put the CPU queue first and agree on new programs; only returning
    programs with nothing cached move, from idleness to size."""
    p = _both_dropped("mori")
    a, b = p.programs["A"], p.programs["B"]
    a.returning = b.returning = returning
    ia, ib = a.idleness(5.0), b.idleness(5.0)
    assert ia < ib  # A has been busier
    assert priority_smallest_first(b, ib) < priority_smallest_first(a, ia)
    assert (priority(b, ib) < priority(a, ia)) is not returning
