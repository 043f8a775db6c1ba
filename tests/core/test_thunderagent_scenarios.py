"""ThunderAgent's scheduler in hand-worked scenarios (capacities of 1,000 tokens: it
reserves 100 per program). ``test_thunderagent_crosscheck`` checks the same policy
against the real router class."""

from __future__ import annotations

import pytest
from scenario_steps import arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote, Release
from mori.core.events import ProgramEnded
from mori.core.execution import engine_actions
from mori.core.policies import POLICIES
from mori.core.types import Capability, Tier

GPU, NONE = Tier.GPU, Tier.NONE


TA = ["thunderagent", "thunderagent+offload"]


@pytest.mark.parametrize("name", TA)
def test_thunderagent_admits_on_arrival_pauses_on_the_tick_resumes_by_group(name: str) -> None:
    p = make(name, gpu=1000, cpu=0)
    assert step(p, 0.0, arrive("A", 400)) == [Promote("A", 0, NONE), Forward("A", 0)]
    # 1000 - 400 - 100 = 500 left: room for B's 300 and its buffer
    assert step(p, 0.0, arrive("B", 300)) == [Promote("B", 0, NONE), Forward("B", 0)]
    assert step(p, 1.0, fin("A", 450), fin("B", 350)) == []  # exactly full
    # C (new) finds no room (0 < 100 + 100): it waits in the paused queue
    assert step(p, 2.0, arrive("C", 100)) == []
    assert p.paused["C"].origin is None
    # A is active: through at once, though it takes the backend over capacity
    assert step(p, 3.0, arrive("A", 500)) == [Forward("A", 0)]
    # the 5 s check: nothing to resume into (-50 left), then the smallest Acting program
    # is paused (its KV is left to the engine's LRU: no engine action)
    assert step(p, 5.0) == [Demote("B", 0, GPU, NONE)]
    # at 10: 400 left; C (100) fits, B (350, and 100) would not fit beside it
    assert step(p, 10.0) == [Promote("C", 0, NONE), Forward("C", 0)]
    assert step(p, 11.0, fin("A", 800)) == []
    assert step(p, 11.0, arrive("B", 360)) == []  # paused: waits for the check
    assert step(p, 15.0) == [Demote("A", 0, GPU, NONE)]
    # at 20: 800 left; B (a held request, ran before) comes before A (no request)
    assert step(p, 20.0) == [Promote("B", 0, NONE), Forward("B", 0)]
    assert set(p.paused) == {"A"}
    assert step(p, 21.0, ProgramEnded("A")) == [Release("A", None)]
    assert p.paused == {}


@pytest.mark.parametrize("name", TA)
def test_thunderagent_marks_every_reasoning_program_of_an_overfull_backend(name: str) -> None:
    p = make(name, gpu=1000, cpu=0)
    step(p, 0.0, arrive("X", 500))
    step(p, 0.0, arrive("Y", 300))
    step(p, 1.0, fin("X", 700))
    assert step(p, 2.0, arrive("X", 700)) == [Forward("X", 0)]  # 700 + 300 + 200 > 1000
    # no Acting program to pause: the smallest Reasoning one is marked, and since marking
    # does not change the remaining capacity ThunderAgent's loop tests, so is the next
    assert step(p, 5.0) == []
    assert p.marked == {"X", "Y"}
    # each is paused when its step ends
    assert step(p, 6.0, fin("Y", 320)) == [Demote("Y", 0, GPU, NONE)]
    assert step(p, 7.0, fin("X", 720)) == [Demote("X", 0, GPU, NONE)]
    assert p.marked == set()
    # at 10 all 1000 are free: Y (one request so far, so in the "new" group) before X
    # (no request); Y without a request is resumed but not forwarded
    assert step(p, 10.0) == [Promote("Y", 0, NONE)]
    assert where(p, "X") == (NONE, None)


@pytest.mark.parametrize("name", TA)
def test_thunderagent_forces_a_resume_after_30_minutes(name: str) -> None:
    p = make(name, gpu=1000, cpu=0)
    step(p, 0.0, arrive("A", 900))
    step(p, 0.5, fin("A", 900))  # A acting: 900 + 100 = 1000 exactly, never paused
    assert step(p, 1.0, arrive("B", 200)) == []
    assert step(p, 1800.0) == []
    assert step(p, 1801.0) == [Promote("B", 0, NONE), Forward("B", 0)]
    assert step(p, 1805.0) == [Demote("A", 0, GPU, NONE)]  # now over capacity


def test_thunderagent_places_a_new_program_on_the_backend_with_fewest_active_tokens() -> None:
    p = make("thunderagent", gpu=1000, cpu=0, replicas=3)
    step(p, 0.0, arrive("A", 300))  # all empty: the first
    step(p, 0.0, arrive("B", 600))  # replica 1
    step(p, 0.0, arrive("C", 100))  # replica 2
    assert [where(p, x)[1] for x in "ABC"] == [0, 1, 2]
    # D (200): the fewest active tokens is replica 2 (100), which has room (800)
    assert step(p, 1.0, arrive("D", 200)) == [Promote("D", 2, NONE), Forward("D", 2)]
    # E (700) has room nowhere (600, 300, 500 left): it waits
    assert step(p, 1.0, arrive("E", 700)) == []
    # the check: E's 800 with its buffer is more than the emptiest backend has
    assert step(p, 5.0) == []
    step(p, 6.0, fin("A", 300))
    assert step(p, 6.0, ProgramEnded("A")) == [Release("A", 0)]
    # at 10 replica 0 is empty: E goes there, the backend with the most left
    assert step(p, 10.0) == [Promote("E", 0, NONE), Forward("E", 0)]


def test_thunderagent_pause_tells_the_engine_nothing() -> None:
    caps = frozenset(Capability)
    for name in TA:
        profile = POLICIES.get(name).engine_profile
        assert engine_actions(Demote("A", 0, GPU, NONE), profile, caps) == ()
    mori = POLICIES.get("mori").engine_profile
    assert engine_actions(Demote("A", 0, GPU, NONE), mori, caps) != ()
