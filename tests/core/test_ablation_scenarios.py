"""Hand-worked scenarios of the ablations that change what MORI observes or how it
ranks: ``mori-binary`` (a threshold instead of a ranking) and ``mori-no-exclusion``
(held time counted as acting)."""

from __future__ import annotations

import pytest
from scenario_steps import CPU, GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.events import KVReady
from mori.core.types import Tier


# -- (f) mori-binary offloads on every round ------------------------------------------------
@pytest.mark.parametrize("cpu,to", [(100, CPU), (0, NONE)])
def test_f_binary_offloads_idle_program_with_room_mori_keeps_it(cpu: int, to: Tier) -> None:
    ps = {n: make(n, cpu=cpu) for n in ("mori-paper", "mori-binary")}
    for p in ps.values():
        step(p, 0.0, arrive("A", 40), arrive("B", 40))
        assert step(p, 1.0, fin("A", 40)) == []  # idleness 0 at the instant
    assert step(ps["mori-binary"], 2.0) == [Demote("A", 0, GPU, to)]  # idleness 0.5
    assert step(ps["mori-paper"], 2.0) == []
    for p in ps.values():
        assert step(p, 3.0, fin("B", 40)) == []
        assert step(p, 5.0) == []  # B: 2/5 < 0.5 stays
    assert where(ps["mori-paper"], "A") == (GPU, 0)
    assert where(ps["mori-binary"], "B") == (GPU, 0)


# -- (g) held time in idleness -----------------------------------------------------------------
def test_g_no_exclusion_counts_kv_reload_time() -> None:
    ps = {n: make(n) for n in ("mori-paper", "mori-no-exclusion")}
    for p in ps.values():
        step(p, 0.0, arrive("A", 10))
        step(p, 2.0, fin("A", 10))
        assert step(p, 3.0, arrive("A", 10)) == [Forward("A", 0)]
        step(p, 5.0, KVReady("A"))  # 3..5 held (reload)
        step(p, 6.0, fin("A", 10))
    assert ps["mori-paper"].programs["A"].idleness(6.0) == pytest.approx(1.0 / 4.0)
    assert ps["mori-no-exclusion"].programs["A"].idleness(6.0) == pytest.approx(3.0 / 6.0)


def test_g_no_exclusion_ranks_the_longest_held_as_most_idle() -> None:
    expected = {}
    ps = {n: make(n, gpu=100, cpu=300) for n in ("mori-paper", "mori-no-exclusion")}
    for p in ps.values():
        step(p, 0.0, arrive("A", 60))
        step(p, 1.0, fin("A", 60))
        assert step(p, 1.0, arrive("B", 60)) == [
            Demote("A", 0, GPU, CPU), Promote("B", 0, NONE), Forward("B", 0)]
        step(p, 2.0, fin("B", 60))
        assert step(p, 2.0, arrive("G", 100)) == [
            Demote("B", 0, GPU, CPU), Promote("G", 0, NONE), Forward("G", 0)]
        # G reasons until t = 30; A returns at 3 (cycle (1, 2)), B at 10 (cycle (1, 8))
        assert step(p, 3.0, arrive("A", 60)) == []
        assert step(p, 10.0, arrive("B", 60)) == []
        assert step(p, 20.0) == []
        expected[p.name] = (p.programs["A"].idleness(30.0), p.programs["B"].idleness(30.0))
    assert expected["mori-paper"] == pytest.approx((2.0 / 3.0, 8.0 / 9.0))
    # held time counted as acting: A (held since 3) 29 of 30, B (since 10) 28 of 29
    assert expected["mori-no-exclusion"] == pytest.approx((29.0 / 30.0, 28.0 / 29.0))
    # G finishes: one of the two CPU-queue programs fits; lowest idleness goes first
    assert step(ps["mori-paper"], 30.0, fin("G", 100)) == [
        Demote("G", 0, GPU, CPU), Promote("A", 0, CPU), Forward("A", 0)]
    assert step(ps["mori-no-exclusion"], 30.0, fin("G", 100)) == [
        Demote("G", 0, GPU, CPU), Promote("B", 0, CPU), Forward("B", 0)]
