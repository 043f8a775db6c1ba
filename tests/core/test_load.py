"""A replica's recent busy share (``mori.core.load.ReplicaLoad``): unit cases and
properties under random step sequences."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core.load import ReplicaLoad


def test_a_replica_nobody_used_reads_busy() -> None:
    load = ReplicaLoad(2, 60.0)
    assert load.share(0, 0.0) == 1.0 and load.share(1, 1e6) == 1.0


def test_idle_time_decays_the_share_and_busy_time_restores_it() -> None:
    load = ReplicaLoad(1, 60.0)
    load.started("a", 0, 0.0)
    load.finished("a", 10.0)
    assert load.share(0, 10.0) == pytest.approx(1.0)
    assert load.share(0, 70.0) == pytest.approx(math.exp(-1.0))  # one window idle
    load.started("b", 0, 70.0)
    # busy for one more window: e^-1 of the idle reading, the rest busy
    assert load.share(0, 130.0) == pytest.approx(math.exp(-2.0) + 1 - math.exp(-1.0))
    assert load.running(0) == 1


def test_two_steps_at_once_count_as_one_busy_engine() -> None:
    load = ReplicaLoad(1, 10.0)
    load.started("a", 0, 0.0)
    load.finished("a", 1.0)
    load.started("a", 0, 100.0)
    load.started("b", 0, 100.0)
    load.finished("a", 101.0)  # b still runs: busy
    before = load.share(0, 101.0)
    assert load.share(0, 200.0) > before and load.running(0) == 1


def test_a_replica_that_went_down_forgets_its_steps() -> None:
    load = ReplicaLoad(2, 10.0)
    load.started("a", 0, 0.0)
    load.started("b", 1, 0.0)
    load.lost(0, 5.0)
    assert load.running(0) == 0 and load.running(1) == 1
    load.finished("a", 6.0)  # its step was lost with the replica: no-op
    assert load.running(0) == 0
    assert load.share(0, 1000.0) < 0.01 and load.share(1, 1000.0) == pytest.approx(1.0)


def test_a_bad_window_is_refused() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="window_s"):
            ReplicaLoad(1, bad)


_ops = st.lists(st.tuples(st.sampled_from(["start", "finish", "lost"]),
                          st.integers(0, 4), st.integers(0, 2),
                          st.floats(0.0, 50.0, allow_nan=False)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_shares_stay_in_range_and_running_counts_match(ops: list[tuple[str, int, int, float]]) -> None:
    """Whatever the order of starts, ends and losses: every share is in [0, 1], each
    replica's running count is the programs whose step runs there."""
    load = ReplicaLoad(3, 20.0)
    where: dict[str, int] = {}
    now = 0.0
    for op, prog, replica, dt in ops:
        now += dt
        pid = f"p{prog}"
        if op == "start":
            load.started(pid, replica, now)
            where[pid] = replica
        elif op == "finish":
            load.finished(pid, now)
            where.pop(pid, None)
        else:
            load.lost(replica, now)
            where = {p: r for p, r in where.items() if r != replica}
        for r in range(3):
            assert load.running(r) == sum(1 for x in where.values() if x == r)
            assert 0.0 <= load.share(r, now) <= 1.0


def test_the_queue_share_follows_the_engines_readings() -> None:
    load = ReplicaLoad(2, 60.0)
    assert load.queue_share(0, 0.0) == 0.0 and load.queue_share(1, 1e6) == 0.0
    load.queued(0, True, 0.0)
    assert load.queue_share(0, 60.0) == pytest.approx(1 - math.exp(-1.0))
    load.queued(0, False, 60.0)
    assert load.queue_share(0, 120.0) == pytest.approx((1 - math.exp(-1.0)) * math.exp(-1.0))
    assert load.queue_share(1, 120.0) == 0.0  # the other replica was never told of one
    load.queued(1, True, 120.0)
    load.lost(1, 180.0)  # a replica that went down has no queue since
    assert load.queue_share(1, 1e6) < 1e-6
