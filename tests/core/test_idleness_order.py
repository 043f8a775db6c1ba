"""``IdlenessOrder`` walks programs in exactly the order a full sort by idleness gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core.idleness import IdlenessTracker
from mori.core.policies.mori import IdlenessAt
from mori.core.policies.mori_index import IdlenessOrder
from mori.core.program import Program
from mori.core.types import Status

DURATION = st.one_of(st.just(0.0), st.floats(0.0, 0.01), st.floats(0.0, 5.0),
                     st.floats(0.0, 4000.0), st.sampled_from([0.5, 1.0, 2.0]))


@st.composite
def program(draw: st.DrawFn, i: int) -> tuple[Program, bool]:
    """A program with a few cycles behind it, now acting or held."""
    tr = IdlenessTracker(draw(st.integers(1, 5)))
    t = draw(st.floats(0.0, 100.0))
    for _ in range(draw(st.integers(0, 6))):
        tr.arrived(t)
        t += draw(DURATION)
        tr.started(t)
        t += draw(DURATION)
        tr.finished(t)
        t += draw(DURATION)
    held = draw(st.booleans())
    if held or tr.status is None:
        tr.arrived(t)
        held = True
    p = Program(f"p{i}", tr, ready_seq=draw(st.integers(0, 10**6)) * 100 + i)
    return p, held


@settings(max_examples=300, deadline=None)
@given(data=st.data(), n=st.integers(0, 40), later=st.lists(DURATION, min_size=1, max_size=3))
def test_descending_is_the_sorted_order(data: st.DataObject, n: int,
                                        later: list[float]) -> None:
    progs = [data.draw(program(i)) for i in range(n)]
    order = IdlenessOrder()
    for p, held in progs:
        order.add(p, p.tracker.idleness(0.0) if held else None)
    # drop some, as programs leave the queue
    for p, _ in progs[::3]:
        order.discard(p.program_id)
    kept = [p for p, _ in progs if p not in [q for q, _ in progs[::3]]]
    assert len(order) == len(kept)
    start = max([0.0] + [p.tracker._t0 for p in kept])  # no earlier than any phase start
    for dt in later:
        now = start + dt
        idleness = IdlenessAt(now)
        want = sorted(kept, key=idleness.desc)
        got = list(order.descending(idleness, now))
        assert [p.program_id for p in got] == [p.program_id for p in want]
        # a fresh walk stopped after one program gives the most idle
        first = next(iter(order.descending(IdlenessAt(now), now)), None)
        assert first is (want[0] if want else None)


def test_only_acting_and_held_programs() -> None:
    tr = IdlenessTracker(5)
    tr.arrived(0.0)
    tr.started(0.0)  # reasoning: neither acting nor held
    p = Program("r", tr)
    assert p.status is Status.REASONING
    order = IdlenessOrder()
    with pytest.raises(AssertionError):  # a Reasoning program is not indexed
        order.add(p, None)
