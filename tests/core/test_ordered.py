"""``SizedOrder`` against a plain sorted list, over hypothesis-generated operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core.ordered import SizedOrder

OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 60), st.integers(0, 50)),
               max_size=300)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, load=st.integers(1, 4), limits=st.lists(st.integers(0, 60), min_size=1),
       after=st.one_of(st.none(), st.integers(-1, 61)))
def test_matches_a_sorted_list(ops: list[tuple[bool, int, int]], load: int,
                               limits: list[int], after: int | None) -> None:
    order: SizedOrder[str] = SizedOrder(load)
    model: dict[tuple[int], int] = {}
    for n, (add, k, size) in enumerate(ops):
        key = (k,)
        if add and key not in model:
            order.add(key, size, f"i{k}")
            model[key] = size
        elif not add and key in model:
            order.remove(key)
            del model[key]
        # prefix() between changes: its tree of block totals is updated in place
        budget = limits[n % len(limits)] * 5
        assert order.prefix(budget) == _prefix(sorted(model.items()), budget)
    want = sorted((k, s, f"i{k[0]}") for k, s in model.items())
    assert list(order) == want
    assert len(order) == len(want)
    assert order.first() == (want[0] if want else None)
    # walk with a limit that changes after each item taken (as a caller placing
    # programs shrinks the room it has)
    steps = iter(limits)
    lim = [next(steps)]  # the limit of the moment, read by walk() after each item
    got = []
    start = None if after is None else (after,)
    for triple in order.walk(lambda: lim[0], start):
        got.append((triple, lim[0]))
        lim[0] = next(steps, lim[0])
    # replay on the model: the items after ``start`` with size <= the limit of the moment
    steps = iter(limits)
    cur = next(steps)
    expect = []
    for k, s, item in want:
        if start is not None and k <= start:
            continue
        if s <= cur:
            expect.append(((k, s, item), cur))
            cur = next(steps, cur)
    assert got == expect
    # the longest prefix that fits a budget
    budget = limits[0] * 5
    assert order.prefix(budget) == _prefix([(k, s) for k, s, _ in want], budget)


def _prefix(items: list[tuple[tuple[int], int]], budget: int) -> tuple[tuple[int] | None, int]:
    """The longest prefix of (key, size) pairs whose sizes fit ``budget``: last key, total."""
    total, last = 0, None
    for k, sz in items:
        if total + sz > budget:
            break
        total, last = total + sz, k
    return last, total


def test_rejects_duplicates_and_missing_keys() -> None:
    order: SizedOrder[str] = SizedOrder()
    order.add((1,), 5, "a")
    with pytest.raises(KeyError):  # a duplicate key
        order.add((1,), 5, "b")
    with pytest.raises(KeyError):  # a missing key
        order.remove((2,))
