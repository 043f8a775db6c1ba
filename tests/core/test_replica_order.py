"""``ReplicaOrder`` (the replicas by room) against the plain answers over its values."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from mori.core.policies.mori_index import ReplicaOrder

VALUES = st.integers(-50, 200)


@given(n=st.integers(1, 6), start=VALUES,
       sets=st.lists(st.tuples(st.integers(0, 5), VALUES), max_size=30),
       query=st.tuples(st.integers(0, 5), VALUES, st.integers(-60, 210)))
def test_replica_order_answers(n: int, start: int, sets: list[tuple[int, int]],
                               query: tuple[int, int, int]) -> None:
    order, plain = ReplicaOrder(n, start), [start] * n
    for r, v in sets:
        order.set(r % n, v)
        plain[r % n] = v
        order.check()
    assert [order[r] for r in range(n)] == plain
    assert order.most() == max(plain)
    r, v, need = query[0] % n, query[1], query[2]
    assert order.most_but(r, v) == max([v, *(x for i, x in enumerate(plain) if i != r)])
    fits = [(x, i) for i, x in enumerate(plain) if x >= need]
    assert order.tightest(need) == (min(fits)[1] if fits else None)
    most_room = min(((-x, i) for x, i in fits), default=None)  # the most, lowest index
    assert order.roomiest(need) == (most_room[1] if most_room else None)
    assert list(order) == sorted(((x, i) for i, x in enumerate(plain)),
                                 key=lambda t: (-t[0], t[1]))
