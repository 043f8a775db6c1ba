"""Several replicas: affinity, Best-Fit-Decreasing, the baselines' routing (docs/system.md, "Several replicas")."""

from __future__ import annotations

from test_scenarios import arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.events import ProgramEnded
from mori.core.policy import Policy
from mori.core.types import Tier

GPU, CPU, NONE = Tier.GPU, Tier.CPU, Tier.NONE


def test_program_in_replica_2_cpu_tier_returns_to_replica_2() -> None:
    p = make("mori", gpu=100, cpu=100, replicas=3)
    step(p, 0.0, arrive("A", 90))  # replica 0
    step(p, 0.0, arrive("B", 90))  # replica 1
    assert step(p, 0.0, arrive("P", 50)) == [Promote("P", 2, NONE), Forward("P", 2)]
    step(p, 1.0, fin("P", 50))
    # Q (80) fits nowhere; A and B are reasoning, P is acting on replica 2: P goes to
    # replica 2's CPU tier and Q takes its place
    assert step(p, 2.0, arrive("Q", 80)) == [Demote("P", 2, GPU, CPU), Promote("Q", 2, NONE),
                                             Forward("Q", 2)]
    assert where(p, "P") == (CPU, 2)
    step(p, 3.0, fin("A", 90), ProgramEnded("A"))  # replica 0 is now empty
    # P returns: its KV is in replica 2's DRAM, so it waits for replica 2 rather than
    # recomputing on the empty replica 0
    assert step(p, 4.0, arrive("P", 55)) == []
    assert where(p, "P") == (CPU, 2)
    # Q's step ends: Q (acting) makes room, P reloads on replica 2; the CPU tier (P's 55
    # of 100 until P leaves it) cannot take Q's 80, and P is not pushed out for it, so Q
    # goes to Waiting
    assert step(p, 5.0, fin("Q", 80)) == [Demote("Q", 2, GPU, NONE), Promote("P", 2, CPU),
                                          Forward("P", 2)]


def test_waiting_programs_placed_best_fit_decreasing() -> None:
    p = make("mori", gpu=100, cpu=0, replicas=2)
    step(p, 0.0, arrive("A", 50))  # both empty: the first best fit, replica 0 (50 free)
    step(p, 0.0, arrive("B", 70))  # fits only replica 1 (30 free)
    assert (where(p, "A"), where(p, "B")) == ((GPU, 0), (GPU, 1))
    # X 25, Y 25, Z 30 arrive at once (free: 50 and 30). Priority order (smallest first,
    # each onto its tightest replica) would put X on replica 1 and leave no room for Z;
    # Best-Fit-Decreasing places Z first, exactly filling replica 1, then X and Y on 0
    out = step(p, 1.0, arrive("X", 25), arrive("Y", 25), arrive("Z", 30))
    assert out == [Promote("Z", 1, NONE), Forward("Z", 1), Promote("X", 0, NONE),
                   Forward("X", 0), Promote("Y", 0, NONE), Forward("Y", 0)]
    assert [q.used for q in p.placement.gpu] == [100, 100]


def test_mori_packs_three_small_programs_onto_one_replica() -> None:
    p = make("mori", gpu=100, cpu=100, replicas=3)
    for x in "ABC":
        step(p, 0.0, arrive(x, 10))
    assert [where(p, x) for x in "ABC"] == [(GPU, 0)] * 3  # the paper's rule: 2 idle


def test_mori_spread_uses_all_three_replicas() -> None:
    p = make("mori-spread", gpu=100, cpu=100, replicas=3)
    for x in "ABC":
        step(p, 0.0, arrive(x, 10))
    assert sorted(where(p, x)[1] for x in "ABC") == [0, 1, 2]
    # arriving together: the largest first, each onto the replica running the fewest
    q = make("mori-spread", gpu=100, cpu=100, replicas=3)
    assert step(q, 0.0, arrive("X", 10), arrive("Y", 30), arrive("Z", 20)) == [
        Promote("Y", 0, NONE), Forward("Y", 0), Promote("Z", 1, NONE), Forward("Z", 1),
        Promote("X", 2, NONE), Forward("X", 2)]


def test_mori_spread_goes_to_the_replica_running_the_fewest() -> None:
    p = make("mori-spread", gpu=100, cpu=100, replicas=2)
    step(p, 0.0, arrive("A", 20), arrive("B", 20))  # one each
    step(p, 1.0, fin("A", 20))  # A acts: replica 0 runs nothing, replica 1 runs B
    # C fits both; replica 0 is idle in compute (A only holds memory there)
    assert step(p, 2.0, arrive("C", 20)) == [Promote("C", 0, NONE), Forward("C", 0)]


def test_mori_spread_packs_once_memory_binds() -> None:
    def two_replicas() -> Policy:
        p = make("mori-spread", gpu=100, cpu=100, replicas=2)
        step(p, 0.0, arrive("A", 84))  # replica 0, still reasoning
        step(p, 0.0, arrive("B", 82))  # replica 1 (none running there)
        step(p, 1.0, fin("B", 82))  # replica 0 runs A, replica 1 runs nothing
        return p

    # 84 + 82 + 12 = 178 of 200 (at most 90%): spread, onto the replica running nothing
    assert step(two_replicas(), 2.0, arrive("C", 12)) == [Promote("C", 1, NONE),
                                                           Forward("C", 1)]
    # 84 + 82 + 16 = 182 (over 90%): memory binds, packed as MORI packs (the tightest fit)
    assert step(two_replicas(), 2.0, arrive("C", 16)) == [Promote("C", 0, NONE),
                                                           Forward("C", 0)]
