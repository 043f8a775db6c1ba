"""``mori-ski``: the ski-rental guard on proactive demotion, in hand-worked scenarios."""

from __future__ import annotations

import pytest
from scenario_steps import arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.types import Tier

GPU, CPU, NONE = Tier.GPU, Tier.CPU, Tier.NONE


def test_ski_rental_guard_waits_until_the_victim_has_acted_as_long_as_its_reload() -> None:
    # 1 byte a token at 1e-8 GB/s = 10 bytes/s: A (40) reloads in 4 s, B (30) in 3 s
    ski = make("mori-ski", gpu=100, cpu=100, reload_gbps=1e-8)
    plain = make("mori", gpu=100, cpu=100)
    for p in (ski, plain):
        step(p, 0.0, arrive("A", 40), arrive("B", 30))
        step(p, 1.0, fin("A", 40), fin("B", 30))
    # C (40) needs room at t = 2: MORI demotes the most idle Acting program at once
    assert step(plain, 2.0, arrive("C", 40)) == [Demote("B", 0, GPU, CPU),
                                                 Promote("C", 0, NONE), Forward("C", 0)]
    # with the guard, A and B have acted 1 s, less than their reloads (4 s, 3 s): C waits
    assert step(ski, 2.0, arrive("C", 40)) == []
    assert step(ski, 3.0) == []
    # at t = 4 B has acted 3 s, as long as its reload: it may go, A (3 of 4 s) may not
    assert step(ski, 4.0) == [Demote("B", 0, GPU, CPU), Promote("C", 0, NONE),
                              Forward("C", 0)]
    assert where(ski, "A") == (GPU, 0)
    # B returns at once and reloads (it waited its reload time out, never more)
    assert ski.reload_s(ski.programs["A"]) == pytest.approx(4.0)


def test_ski_rental_guard_leaves_overflow_unguarded() -> None:
    p = make("mori-ski", gpu=100, cpu=100, reload_gbps=1e-8)
    step(p, 0.0, arrive("A", 40), arrive("B", 40))
    step(p, 1.0, fin("A", 40))
    # B's step ends at 70 tokens: 110 > 100, and A (acting 0.5 s, reload 4 s) goes anyway
    assert step(p, 1.5, fin("B", 70)) == [Demote("A", 0, GPU, CPU)]
