"""IdlenessTracker against hand-computed windows (docs/system.md, "Idleness")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core.idleness import IdlenessHistory, IdlenessTracker
from mori.core.policy import PolicyConfig


def run_cycles(t: IdlenessTracker, cycles: list[tuple[float, float]], start: float = 0.0) -> float:
    """Feed complete cycles (reasoning, acting) with no held time; return the time reached.

    After the call the tracker is held (the request that ends the last tool call has
    arrived and is not yet started).
    """
    now = start
    t.arrived(now)
    for reason, act in cycles:
        t.started(now)
        now += reason
        t.finished(now)
        now += act
        t.arrived(now)
    return now


# -- a new program ------------------------------------------------------------------
def test_new_program_is_busy() -> None:
    t = IdlenessTracker()
    assert t.idleness(0.0) == 0.0
    assert t.idleness(100.0) == 0.0
    t.arrived(1.0)
    assert t.idleness(50.0) == 0.0  # held, no history
    t.started(2.0)
    assert t.idleness(3.0) == 0.0  # reasoning only
    assert t.cycles == ()


def test_no_exclusion_first_held_interval_is_dropped() -> None:
    t = IdlenessTracker(exclude_held=False)
    t.arrived(0.0)
    assert t.idleness(1.5) == 0.0  # no previous cycle to charge the held time to
    t.started(2.0)
    assert t.held_time == 2.0
    t.finished(3.0)
    assert t.idleness(3.0) == 0.0
    assert t.idleness(5.0) == pytest.approx(2.0 / 3.0)  # 1 s reasoning, 2 s acting


# -- one cycle ----------------------------------------------------------------------
def test_one_cycle_one_second_reasoning_three_acting() -> None:
    t = IdlenessTracker()
    t.arrived(0.0)
    t.started(0.0)
    t.finished(1.0)
    assert t.idleness(4.0) == pytest.approx(0.75)
    t.arrived(4.0)
    assert t.cycles == ((1.0, 3.0),)
    assert t.idleness(4.0) == pytest.approx(0.75)
    assert t.idleness(9.0) == pytest.approx(0.75)  # held time does not count


def test_in_progress_gap_counts() -> None:
    t = IdlenessTracker()
    t.arrived(0.0)
    t.started(0.0)
    t.finished(1.0)
    assert t.idleness(1.0) == 0.0
    assert t.idleness(2.0) == pytest.approx(0.5)
    assert t.idleness(3.0) == pytest.approx(2.0 / 3.0)
    assert t.idleness(4.0) == pytest.approx(0.75)
    assert t.idleness(11.0) == pytest.approx(10.0 / 11.0)
    values = [t.idleness(1.0 + 0.5 * i) for i in range(40)]
    assert values == sorted(values)
    assert len(set(values)) == len(values)  # strictly rising


def test_reasoning_in_progress_counts() -> None:
    t = IdlenessTracker()
    run_cycles(t, [(1.0, 3.0)])  # ends held at 4
    t.started(4.0)
    assert t.idleness(4.0) == pytest.approx(3.0 / 4.0)
    assert t.idleness(6.0) == pytest.approx(3.0 / 6.0)  # reasoning 1 + 2, acting 3


# -- the window ---------------------------------------------------------------------
SIX = [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0), (1.0, 4.0), (1.0, 5.0), (1.0, 6.0)]


def test_k5_window_drops_the_oldest_cycle() -> None:
    t = IdlenessTracker(k=5)
    end = run_cycles(t, SIX)
    assert end == 27.0
    # held: the last five completed cycles: acting 2+3+4+5+6 = 20, reasoning 5
    assert t.cycles == tuple(SIX[1:])
    assert t.idleness(end) == pytest.approx(20.0 / 25.0)
    # all six would give 21/27
    assert t.idleness(end) != pytest.approx(21.0 / 27.0)


def test_while_acting_the_in_progress_cycle_is_one_of_k() -> None:
    t = IdlenessTracker(k=5)
    end = run_cycles(t, SIX[:5])  # five completed cycles, held at 20
    assert end == 20.0
    t.started(20.0)
    # reasoning: window = cycles 2..5 (acting 2+3+4+5 = 14, reasoning 4) + current
    assert t.idleness(20.5) == pytest.approx(14.0 / (4.0 + 0.5 + 14.0))
    t.finished(21.0)
    # acting x seconds: (14 + x) / (4 + 1 + 14 + x)
    for x in (0.0, 1.0, 3.5, 6.0):
        assert t.idleness(21.0 + x) == pytest.approx((14.0 + x) / (19.0 + x))
    t.arrived(27.0)
    assert t.idleness(27.0) == pytest.approx(20.0 / 25.0)


def test_window_smaller_than_k() -> None:
    t = IdlenessTracker(k=5)
    run_cycles(t, [(2.0, 2.0), (1.0, 5.0)])  # held at 10
    assert t.idleness(10.0) == pytest.approx(7.0 / 10.0)
    t.started(10.0)
    t.finished(13.0)  # reasoning 3
    assert t.idleness(14.0) == pytest.approx((7.0 + 1.0) / (10.0 + 3.0 + 1.0))


def test_k1_only_the_current_cycle() -> None:
    t = IdlenessTracker(k=1)
    run_cycles(t, [(1.0, 9.0)])  # held at 10: window = last completed cycle
    assert t.idleness(10.0) == pytest.approx(0.9)
    t.started(10.0)
    assert t.idleness(12.0) == 0.0  # the in-progress cycle is the whole window
    t.finished(12.0)
    assert t.idleness(14.0) == pytest.approx(0.5)


# -- held time ----------------------------------------------------------------------
def _held_history(t: IdlenessTracker) -> None:
    t.arrived(0.0)
    t.started(0.0)
    t.finished(1.0)
    t.arrived(4.0)  # cycle (1, 3)
    t.started(10.0)  # held 6 s
    t.finished(11.0)  # reasoning 1


def test_held_time_is_excluded() -> None:
    t = IdlenessTracker()
    t.arrived(0.0)
    t.started(0.0)
    t.finished(1.0)
    t.arrived(4.0)
    assert t.idleness(8.0) == pytest.approx(0.75)  # while held: unchanged
    t.started(10.0)
    assert t.held_time == 6.0
    assert t.idleness(10.0) == pytest.approx(0.75)
    t.finished(11.0)
    assert t.idleness(11.0) == pytest.approx(3.0 / 5.0)
    assert t.cycles == ((1.0, 3.0),)


def test_held_time_added_to_previous_acting_without_exclusion() -> None:
    t = IdlenessTracker(exclude_held=False)
    t.arrived(0.0)
    t.started(0.0)
    t.finished(1.0)
    t.arrived(4.0)
    # while held the gap in progress counts as acting of the previous cycle
    assert t.idleness(8.0) == pytest.approx(7.0 / 8.0)
    t.started(10.0)
    assert t.cycles == ((1.0, 9.0),)
    assert t.held_time == 6.0
    t.finished(11.0)
    assert t.idleness(11.0) == pytest.approx(9.0 / 11.0)


def test_kv_ready_after_forward_moves_start_and_counts_as_held() -> None:
    for exclude, cycle, expected in ((True, (1.0, 3.0), 3.0 / 5.0),
                                     (False, (1.0, 5.0), 5.0 / 7.0)):
        t = IdlenessTracker(exclude_held=exclude)
        t.arrived(0.0)
        t.started(0.0)
        t.finished(1.0)
        t.arrived(4.0)
        t.started(4.0)  # forwarded
        assert t.idleness(5.0) == pytest.approx(3.0 / 5.0)  # provisional: reasoning since 4
        t.started(6.0)  # KV ready: 4..6 was held
        assert t.held_time == 2.0
        assert t.cycles == (cycle,)
        t.finished(7.0)  # reasoning 6..7
        assert t.idleness(7.0) == pytest.approx(expected)


def test_kv_ready_on_first_step() -> None:
    t = IdlenessTracker()
    t.arrived(0.0)
    t.started(0.0)
    t.started(3.0)
    assert t.held_time == 3.0
    t.finished(4.0)
    assert t.idleness(5.0) == pytest.approx(0.5)  # reasoning 1 (3..4), acting 1


# -- misuse -------------------------------------------------------------------------
@pytest.mark.parametrize("calls", [
    ["started"],
    ["finished"],
    ["arrived", "finished"],
    ["arrived", "arrived"],
    ["arrived", "started", "arrived"],
    ["arrived", "started", "finished", "started"],
    ["arrived", "started", "finished", "finished"],
])
def test_out_of_order_observations_raise(calls: list[str]) -> None:
    t = IdlenessTracker()
    for name in calls[:-1]:
        getattr(t, name)(0.0)
    with pytest.raises(ValueError):
        getattr(t, calls[-1])(1.0)


@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one_raises(k: int) -> None:
    with pytest.raises(ValueError):
        IdlenessTracker(k=k)
    with pytest.raises(ValueError):
        PolicyConfig(idleness_window=k)


def test_time_going_backwards_is_refused() -> None:
    t = IdlenessTracker()
    t.arrived(5.0)
    with pytest.raises(ValueError, match="backwards"):
        t.started(4.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(1, 50), st.integers(0, 50)),
                min_size=1, max_size=9),
       st.integers(1, 5), st.integers(0, 30), st.integers(0, 1000))
def test_a_history_taken_back_gives_the_same_idleness(
        steps: list[tuple[int, int, int]], k: int, tail: int, offset: int) -> None:
    """``restored(now, history(then))`` on a fresh tracker, at another clock's ``now``,
    gives the idleness the old tracker gives at ``then``, now and as time goes on."""
    old = IdlenessTracker(k)
    t = 0.0
    for held, reason, act in steps:
        old.arrived(t)
        old.started(t + held)
        old.finished(t + held + reason)
        t += held + reason + act
    then = t + tail
    h = old.history(then)
    assert len(h.cycles) <= k and h.acting_s == then - (t - steps[-1][2])
    new = IdlenessTracker(k)
    new.restored(float(offset), h)  # another gateway's clock
    for later in (0.0, 1.0, 7.5):
        assert new.idleness(offset + later) == pytest.approx(old.idleness(then + later))
    assert new.acting_line() is not None


def test_a_history_later_adds_the_downtime_to_the_tool_call() -> None:
    t = IdlenessTracker(3)
    t.arrived(0.0)
    t.started(0.0)
    t.finished(2.0)  # 2 s reasoning, then acting
    h = t.history(4.0)  # 2 s into the tool call
    assert h == IdlenessHistory((), 2.0, 2.0)
    assert h.later(6.0) == IdlenessHistory((), 2.0, 8.0)
    fresh = IdlenessTracker(3)
    fresh.restored(100.0, h.later(6.0))
    assert fresh.idleness(100.0) == pytest.approx(8.0 / 10.0)
    # a step cut off mid-way keeps only the completed cycles, and no downtime
    t.arrived(5.0)
    t.started(5.0)
    cut = t.history(6.0)
    assert cut == IdlenessHistory(((2.0, 3.0),)) and cut.later(60.0) == cut


def test_a_restored_program_without_history_acts_from_the_restore() -> None:
    t = IdlenessTracker(3)
    t.restored(50.0)
    assert t.idleness(50.0) == 0.0 and t.idleness(51.0) == 1.0


@pytest.mark.parametrize("bad", [dict(cycles=((1.0, -1.0),)), dict(acting_s=float("nan")),
                                 dict(reasoning_s=float("inf")), dict(cycles=((1.0,),))])
def test_a_bad_history_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="idleness history"):
        IdlenessHistory(**bad)  # type: ignore[arg-type]
