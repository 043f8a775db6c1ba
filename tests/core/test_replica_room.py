"""Room on every replica (``RoomMaker.each_replica``): with several replicas, a replica
where no room was made in a round makes room for its own first parked candidate, if its
Acting programs can make it now, instead of holding it behind another replica's
candidate that waits for running steps to end. The paper's rule (``mori-paper``) lets
only the round's first candidate make room.

Capacities in tokens (1 byte each): two replicas, a GPU tier of 100 and a CPU tier of
200 each; no engine costs are known, so a park pays at once.
"""

from __future__ import annotations

from scenario_steps import CPU, GPU, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.policy import Policy


def _two_parked(name: str) -> Policy:
    """A parked on replica 0 behind C, which reasons there; B parked on replica 1,
    where D, in its tool call, fills the GPU."""
    p = make(name, gpu=100, cpu=200, replicas=2)
    step(p, 0.0, arrive("A", 50), arrive("B", 50))
    step(p, 1.0, fin("A", 50), fin("B", 50))
    step(p, 2.0, arrive("C", 100))  # A parks on replica 0 for it
    step(p, 3.0, arrive("D", 100))  # B parks on replica 1 for it
    step(p, 4.0, fin("D", 100))
    assert where(p, "A") == (CPU, 0) and where(p, "B") == (CPU, 1)
    assert where(p, "C") == (GPU, 0) and where(p, "D") == (GPU, 1)
    return p


def test_a_replica_makes_room_for_its_own_parked_program() -> None:
    """A comes first but must wait for C's step to end; B's replica makes room at once
    by parking D, which is in its tool call."""
    p = _two_parked("mori")
    out = step(p, 5.0, arrive("A", 50), arrive("B", 50))
    assert out == [Demote("D", 1, GPU, CPU), Promote("B", 1, CPU), Forward("B", 1)]
    assert where(p, "A") == (CPU, 0)


def test_the_paper_rule_holds_it_behind_the_other_replica() -> None:
    p = _two_parked("mori-paper")
    assert step(p, 5.0, arrive("A", 50), arrive("B", 50)) == []
    assert where(p, "B") == (CPU, 1) and where(p, "D") == (GPU, 1)


def test_a_replica_that_made_room_makes_no_more() -> None:
    """Once A's replica has room (C's step ended), A is the round's first candidate and
    makes it; B, on the other replica, makes its own in the same round."""
    p = _two_parked("mori")
    step(p, 4.5, fin("C", 100))
    out = step(p, 5.0, arrive("A", 50), arrive("B", 50))
    assert Forward("A", 0) in out and Forward("B", 1) in out
    assert where(p, "C") == (CPU, 0) and where(p, "D") == (CPU, 1)
