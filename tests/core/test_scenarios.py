"""Tiny hand-worked scenarios: capacities in tokens (page 1, 1 byte per token)."""

from __future__ import annotations

import pytest
from scenario_steps import CPU, GPU, NONE, UNBUFFERED, arrive, check_order, fin, make, step, where

from mori.core.decisions import Decision, Demote, Forward, Promote, Release
from mori.core.events import ProgramEnded, StepFinished
from mori.core.policies import PAPER_POLICIES, POLICIES
from mori.core.policy import Policy
from mori.core.types import Status


# -- (a) both fit ------------------------------------------------------------------------
@pytest.mark.parametrize("name", UNBUFFERED)
def test_a_two_programs_fit(name: str) -> None:
    p = make(name)
    assert step(p, 0.0, arrive("A", 40)) == [Promote("A", 0, NONE), Forward("A", 0)]
    assert step(p, 0.0, arrive("B", 40)) == [Promote("B", 0, NONE), Forward("B", 0)]
    for pid in "AB":
        assert p.programs[pid].status is Status.REASONING
        assert p.programs[pid].tier is GPU and p.programs[pid].replica == 0
    if p.cluster.gpu_bytes is not None:
        assert p.placement.gpu[0].used == 80


@pytest.mark.parametrize("name", UNBUFFERED)
def test_a_simultaneous_arrivals_order(name: str) -> None:
    p = make(name)
    out = step(p, 0.0, arrive("X", 30), arrive("Y", 40), arrive("Z", 20))
    # smg: arrival order; MORI: all three are admitted (they fit together) and placed
    # Best-Fit-Decreasing, the largest first
    order = {"smg": "XYZ", "lru-offload": "XYZ"}.get(name, "YXZ")
    assert out == [d for pid in order for d in (Promote(pid, 0, NONE), Forward(pid, 0))]


@pytest.mark.parametrize("name", ["mori-paper", "mori-strict", "mori-no-exclusion", "mori-binary"])
def test_a_new_arrivals_admitted_smallest_first_placed_largest_first(name: str) -> None:
    p = make(name)
    out = step(p, 0.0, arrive("X", 30), arrive("Y", 40), arrive("W", 50), arrive("Z", 20))
    # priority (smallest context first) admits Z, X, Y (90 of 100); W (50) must wait even
    # though it arrived before Z; the admitted three are placed largest first
    assert out == [d for pid in "YXZ" for d in (Promote(pid, 0, NONE), Forward(pid, 0))]
    assert p.programs["W"].status is Status.HELD and where(p, "W") == (NONE, None)


# -- (b) a third program needs room ---------------------------------------------------------
def _setup_b(name: str) -> Policy:
    """A (40): 1 s reasoning then acting since t=1 (idleness 0.9 at t=10).
    B (30): 9 s reasoning then acting since t=9 (idleness 0.1 at t=10)."""
    p = make(name)
    step(p, 0.0, arrive("A", 40))
    step(p, 0.0, arrive("B", 30))
    assert step(p, 1.0, fin("A", 40)) == []
    step(p, 9.0, fin("B", 30))
    return p


B_EXPECTED = {
    "mori-paper": [Demote("A", 0, GPU, CPU), Promote("C", 0, NONE), Forward("C", 0)],
    "mori-no-exclusion": [Demote("A", 0, GPU, CPU), Promote("C", 0, NONE), Forward("C", 0)],
    "mori-strict": [Demote("A", 0, GPU, CPU), Promote("C", 0, NONE), Forward("C", 0)],
    "smg": [Promote("C", 0, NONE), Forward("C", 0)],
}


@pytest.mark.parametrize("name", sorted(B_EXPECTED))
def test_b_third_program_makes_room(name: str) -> None:
    p = _setup_b(name)
    idleness_a, idleness_b = p.programs["A"].idleness(10.0), p.programs["B"].idleness(10.0)
    assert idleness_a == pytest.approx(0.9)
    assert idleness_b == pytest.approx(0.1)
    out = step(p, 10.0, arrive("C", 40))
    assert out == B_EXPECTED[name]
    if name == "smg":
        assert not any(isinstance(d, Demote) for d in out)
    if name.startswith("mori"):
        assert where(p, "A") == (CPU, 0)
        assert where(p, "B") == (GPU, 0)
        assert p.placement.gpu[0].used == 70 and p.placement.cpu[0].used == 40
    else:
        assert where(p, "A") == where(p, "B") == where(p, "C") == (GPU, 0)


def test_b_mori_binary_offloaded_early() -> None:
    # mori-binary offloads A as soon as it is idle (idleness >= 0.5), here at B's finish
    p = make("mori-binary")
    step(p, 0.0, arrive("A", 40))
    step(p, 0.0, arrive("B", 30))
    assert step(p, 1.0, fin("A", 40)) == []
    assert step(p, 9.0, fin("B", 30)) == [Demote("A", 0, GPU, CPU)]
    assert step(p, 10.0, arrive("C", 40)) == [Promote("C", 0, NONE), Forward("C", 0)]


# -- (c) promotion priority ------------------------------------------------------------------
def test_c_priority_levels() -> None:
    p = make("mori-paper", gpu=100, cpu=50)
    step(p, 0.0, arrive("A", 40))
    step(p, 0.0, arrive("B", 40))
    step(p, 1.0, fin("A", 40))
    step(p, 2.0, fin("B", 40))
    # C (100) needs the whole GPU: A (idleness 0.9) goes first, to CPU; then B (0.8) does not
    # fit the CPU, A is more idle than B so A is pushed on to Uncached and B takes the CPU
    assert step(p, 10.0, arrive("C", 100)) == [
        Demote("A", 0, GPU, CPU), Demote("A", 0, CPU, NONE), Demote("B", 0, GPU, CPU),
        Promote("C", 0, NONE), Forward("C", 0)]
    assert where(p, "A") == (NONE, None) and where(p, "B") == (CPU, 0)
    step(p, 11.0, fin("C", 100))
    assert step(p, 12.0, ProgramEnded("C")) == [Release("C", 0)]
    # arrivals in the reverse of their priority: D (new, 30), E (new, 20), A (Uncached,
    # returning), B (CPU queue); 130 tokens for 100
    out = step(p, 20.0, arrive("D", 30), arrive("E", 20), arrive("A", 40), arrive("B", 40))
    assert out == [Promote("B", 0, CPU), Forward("B", 0),
                   Promote("A", 0, NONE), Forward("A", 0),
                   Promote("E", 0, NONE), Forward("E", 0)]
    assert p.programs["D"].ready and where(p, "D") == (NONE, None)
    # D waits for a step to finish: A (most idle) is demoted lazily, when its step ends
    assert step(p, 20.5) == []
    assert step(p, 21.0, fin("A", 40)) == [
        Demote("A", 0, GPU, CPU), Promote("D", 0, NONE), Forward("D", 0)]


def _setup_c_cpu(name: str) -> Policy:
    p = make(name, gpu=100, cpu=100)
    step(p, 0.0, arrive("B", 60))
    step(p, 1.0, fin("B", 60))
    assert step(p, 2.0, arrive("X", 100)) == [
        Demote("B", 0, GPU, CPU), Promote("X", 0, NONE), Forward("X", 0)]
    assert step(p, 3.0, fin("X", 100)) == []
    return p


def test_c_strict_cpu_program_first_waits_for_someone_more_idle() -> None:
    p = _setup_c_cpu("mori-strict")
    # B returns (cycle (1, 2): idleness 2/3) to its CPU queue; W (new, 10) arrives too.
    assert step(p, 3.0, arrive("B", 60)) == []
    assert step(p, 3.0, arrive("W", 10)) == []
    assert p.programs["B"].idleness(3.0) == pytest.approx(2.0 / 3.0)
    # X's idleness is (t - 3) / (t - 2): not above B's 2/3 until t > 5; B (level 0) is the
    # candidate that may make room, W may only take free space
    assert step(p, 4.0) == []
    assert step(p, 5.0) == []
    # t = 6: X at 3/4 is demoted; the CPU (B 60 of 100) cannot take X's 100 and B is not
    # more idle than X, so X drops to Uncached; then B reloads, then W fits
    assert step(p, 6.0) == [Demote("X", 0, GPU, NONE), Promote("B", 0, CPU), Forward("B", 0),
                            Promote("W", 0, NONE), Forward("W", 0)]


def test_c_mori_cpu_program_before_new_one() -> None:
    p = _setup_c_cpu("mori-paper")
    # B (CPU queue) and W (new) arrive together; X (acting) makes room for B at once
    out = step(p, 3.0, arrive("W", 10), arrive("B", 60))
    promoted = [d.program_id for d in out if isinstance(d, Promote)]
    assert promoted == ["B", "W"]
    assert where(p, "X") != (GPU, 0)


@pytest.mark.parametrize("name", ["mori-paper", "mori-no-exclusion"])
def test_c_candidate_not_evicted_from_cpu_to_make_room_for_its_victim(name: str) -> None:
    p = _setup_c_cpu(name)
    out = step(p, 3.0, arrive("B", 60))
    # actual: [Demote(B, CPU->NONE), Demote(X, GPU->CPU), Promote(B, source=NONE), Forward]
    assert Demote("B", 0, CPU, NONE) not in out
    assert Promote("B", 0, CPU) in out
    assert out[-1] == Forward("B", 0)


def test_c_returning_before_new_smallest_new_first() -> None:
    p = make("mori-paper", gpu=100, cpu=0)
    step(p, 0.0, arrive("R", 30))
    step(p, 1.0, fin("R", 30))
    assert step(p, 2.0, arrive("Y", 100)) == [
        Demote("R", 0, GPU, NONE), Promote("Y", 0, NONE), Forward("Y", 0)]
    step(p, 3.0, fin("Y", 100))
    step(p, 4.0, ProgramEnded("Y"))
    out = step(p, 5.0, arrive("N4", 6), arrive("N3", 40), arrive("N1", 5), arrive("R", 35),
               arrive("N2", 20))
    # returning R first, then the new ones smallest first: R 35, N1 5, N4 6, N2 20 (66);
    # N3 (40) would pass 100: it waits. Placement is largest first.
    assert out == [Promote("R", 0, NONE), Forward("R", 0), Promote("N2", 0, NONE),
                   Forward("N2", 0), Promote("N4", 0, NONE), Forward("N4", 0),
                   Promote("N1", 0, NONE), Forward("N1", 0)]
    assert where(p, "N3") == (NONE, None)


def test_c_candidate_not_evicted_from_cpu_two_replicas() -> None:
    # regression: the candidate X was evicted to Uncached by the room made for it, then
    # held (its turn in the round was over) although replica 1 was empty (packed
    # placement, as this was found: MORI itself spreads the first programs)
    p = make("mori-pack", gpu=100, cpu=60, replicas=2)
    step(p, 0.0, arrive("X", 60))
    step(p, 0.0, arrive("R", 40))
    step(p, 0.0, arrive("Y", 100))
    assert [set(q.members) for q in p.placement.gpu] == [{"X", "R"}, {"Y"}]
    step(p, 1.0, fin("X", 60), fin("Y", 100))
    assert step(p, 2.0, arrive("B", 30)) == [
        Demote("X", 0, GPU, CPU), Promote("B", 0, NONE), Forward("B", 0)]
    assert step(p, 2.0, arrive("S", 30)) == [Promote("S", 0, NONE), Forward("S", 0)]
    step(p, 3.0, fin("B", 30), ProgramEnded("Y"))  # replica 1 is empty now
    out = step(p, 4.0, arrive("X", 60))
    assert Demote("X", 0, CPU, NONE) not in out
    # affinity: X reloads on replica 0 only (it waits for R's or S's step there, though
    # replica 1 is idle)
    assert where(p, "X") == (CPU, 0) and p.programs["X"].ready


# -- (d) lazy demotion -----------------------------------------------------------------------
def test_d_lazy_demotion_waits_for_the_step() -> None:
    p = make("mori-paper")
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 10.0, arrive("A", 60)) == [Forward("A", 0)]
    # A reasons with idleness 9/11 at t = 11: more idle than the new B, but Reasoning
    assert step(p, 11.0, arrive("B", 50)) == []  # A will be demoted when its step ends
    assert p.programs["B"].ready and where(p, "B") == (NONE, None)
    assert step(p, 11.5) == []
    assert step(p, 12.0, fin("A", 60)) == [
        Demote("A", 0, GPU, CPU), Promote("B", 0, NONE), Forward("B", 0)]


def test_d_strict_new_reasoning_program_not_marked_then_demoted_on_tick() -> None:
    p = make("mori-strict")
    step(p, 0.0, arrive("A", 60))
    assert step(p, 1.0, arrive("B", 50)) == []  # idleness 0 is not above B's 0: no room made
    assert step(p, 2.0, fin("A", 60)) == []  # acting for 0 s: idleness still 0
    assert step(p, 3.0) == [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE), Forward("B", 0)]


def test_d_mori_any_reasoning_program_marked() -> None:
    p = make("mori-paper")
    step(p, 0.0, arrive("A", 60))
    assert step(p, 1.0, arrive("B", 50)) == []  # A is demoted when its step ends
    assert step(p, 1.5) == []
    assert step(p, 2.0, fin("A", 60)) == [
        Demote("A", 0, GPU, CPU), Promote("B", 0, NONE), Forward("B", 0)]


# -- (e) growth past the GPU capacity --------------------------------------------------------
E_ARRIVAL = {
    "mori-paper": [Demote("A", 0, GPU, CPU), Forward("B", 0)],
    "mori-no-exclusion": [Demote("A", 0, GPU, CPU), Forward("B", 0)],
    "mori-strict": [Demote("A", 0, GPU, CPU), Forward("B", 0)],
    "smg": [Forward("B", 0)],
}


@pytest.mark.parametrize("name", sorted(E_ARRIVAL))
def test_e_growth_on_arrival_demotes_an_acting_program(name: str) -> None:
    p = make(name)
    step(p, 0.0, arrive("A", 40))
    step(p, 0.0, arrive("B", 40))
    step(p, 1.0, fin("A", 40))
    step(p, 2.0, fin("B", 40))
    assert step(p, 5.0, arrive("B", 70)) == E_ARRIVAL[name]


@pytest.mark.parametrize("name", sorted(E_ARRIVAL))
def test_e_growth_on_finish(name: str) -> None:
    p = make(name)
    step(p, 0.0, arrive("A", 40))
    step(p, 0.0, arrive("B", 40))
    expected = {"smg": []}.get(name, [Demote("A", 0, GPU, CPU if name.startswith("mori")
                                              else NONE)])
    assert step(p, 1.0, fin("A", 70)) == expected


def test_e_mori_demotes_most_idle_acting_first_then_held() -> None:
    p = make("mori-paper", gpu=100, cpu=200)
    step(p, 0.0, arrive("A", 30), arrive("B", 30), arrive("C", 30))
    step(p, 1.0, fin("A", 30))
    step(p, 3.0, fin("B", 30))
    step(p, 4.0, fin("C", 30))
    # t = 5: A 4/5, B 2/5, C 1/4 ... C's request grows to 60: 120 > 100
    assert step(p, 5.0, arrive("C", 60)) == [Demote("A", 0, GPU, CPU), Forward("C", 0)]
    # B's request grows to 80: 140 > 100; no Acting program left, so the held B goes
    assert step(p, 6.0, arrive("B", 80)) == [Demote("B", 0, GPU, CPU)]
    assert p.programs["B"].ready and where(p, "B") == (CPU, 0)


def test_e_program_larger_than_the_gpu_is_never_forwarded() -> None:
    # documented: a request that can never fit is skipped ("refused up front by the
    # simulator"); the policy holds it forever
    p = make("mori-paper")
    step(p, 0.0, arrive("A", 40))
    step(p, 1.0, fin("A", 40))
    assert step(p, 2.0, arrive("A", 150)) == [Demote("A", 0, GPU, NONE)]
    for t in (3.0, 10.0, 1000.0):
        assert step(p, t) == []
    assert p.programs["A"].ready


# -- (h) program end ---------------------------------------------------------------------------
def test_h_release_from_each_tier() -> None:
    p = make("mori-paper", gpu=100, cpu=100)
    step(p, 0.0, arrive("A", 60), arrive("B", 30))
    step(p, 1.0, fin("A", 60), fin("B", 30))
    # C (40): B and A both at idleness 0.8; the latest request (B) goes first; that suffices
    assert step(p, 5.0, arrive("C", 40)) == [
        Demote("B", 0, GPU, CPU), Promote("C", 0, NONE), Forward("C", 0)]
    # D (90): A (acting) to CPU now, C (reasoning) when its step ends; D waits
    assert step(p, 6.0, arrive("D", 90)) == [Demote("A", 0, GPU, CPU)]
    assert where(p, "D") == (NONE, None) and p.programs["D"].ready
    assert step(p, 7.0, ProgramEnded("B")) == [Release("B", 0)]
    assert p.placement.cpu[0].used == 60
    assert step(p, 7.0, ProgramEnded("D")) == [Release("D", None)]
    assert p.ready_programs == []
    assert step(p, 8.0, ProgramEnded("A")) == [Release("A", 0)]
    assert p.placement.cpu[0].used == 0
    step(p, 9.0, fin("C", 40))
    assert step(p, 9.0, ProgramEnded("C")) == [Release("C", 0)]
    assert p.placement.gpu[0].used == 0
    assert p.programs == {} and len(p.placement) == 0


_H_LAZY = ([], [Demote("A", 0, GPU, CPU), Promote("B", 0, NONE), Forward("B", 0)],
           [Release("A", 0)])
H_END = {
    "mori-paper": _H_LAZY,
    "mori": _H_LAZY,  # the CPU tier has room: A parks at once
    "mori-no-exclusion": _H_LAZY,
    "mori-pack": _H_LAZY,  # one replica: MORI
    "mori-yield": _H_LAZY,  # one replica: MORI
    "mori-strict": ([], [], [Release("A", 0), Promote("B", 0, NONE), Forward("B", 0)]),
    "mori-binary": ([], [], [Release("A", 0), Promote("B", 0, NONE), Forward("B", 0)]),
    # A has acted 0 s when its step ends, less than any reload: it is not displaced
    "mori-ski": ([], [], [Release("A", 0), Promote("B", 0, NONE), Forward("B", 0)]),
    "smg": ([Promote("B", 0, NONE), Forward("B", 0)], [], [Release("A", 0)]),
    "lru-offload": ([Promote("B", 0, NONE), Forward("B", 0)], [], [Release("A", 0)]),
}


@pytest.mark.parametrize("name", UNBUFFERED)
def test_h_end_releases_and_frees_room(name: str) -> None:
    at_arrival, at_finish, at_end = H_END[name]
    p = make(name)
    step(p, 0.0, arrive("A", 60))
    assert step(p, 0.0, arrive("B", 50)) == at_arrival
    assert step(p, 1.0, fin("A", 60)) == at_finish
    assert step(p, 1.0, ProgramEnded("A")) == at_end
    assert "A" not in p.placement and "A" not in p.programs
    assert where(p, "B") == (GPU, 0)


# -- (i) order within a decision list ----------------------------------------------------------
@pytest.mark.parametrize("name", UNBUFFERED)
def test_i_promote_precedes_forward_and_demotes_precede_promote(name: str) -> None:
    # step() replays every list: a Forward only for a program in a GPU queue at that
    # point, a Promote only into room made by the Demotes before it
    p = make(name, gpu=100, cpu=40)
    seen: list[Decision] = []
    seen += step(p, 0.0, arrive("A", 30), arrive("B", 30), arrive("C", 40))
    seen += step(p, 1.0, fin("A", 30), fin("B", 30))
    seen += step(p, 2.0, fin("C", 40))
    for t, ev in ((5.0, arrive("D", 50)), (6.0, arrive("A", 35)), (7.0, arrive("B", 45)),
                  (8.0, fin("D", 50)), (9.0, arrive("C", 45)), (20.0, None)):
        if isinstance(ev, StepFinished) and p.programs[ev.program_id].status is not \
                Status.REASONING:
            ev = None  # D was not admitted
        seen += step(p, t, *([ev] if ev else []))
    assert sum(isinstance(d, Forward) for d in seen) >= 4
    if name not in ("smg", "lru-offload"):
        assert any(isinstance(d, Demote) for d in seen)


def test_i_forward_before_promote_is_caught() -> None:
    with pytest.raises(AssertionError):
        check_order([Forward("A", 0), Promote("A", 0, NONE)])


@pytest.mark.parametrize("name", PAPER_POLICIES)
def test_paper_policies_registered(name: str) -> None:
    assert name in POLICIES
