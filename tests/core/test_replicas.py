"""Several replicas: affinity, Best-Fit-Decreasing, the baselines' routing (docs/system.md, "Several replicas")."""

from __future__ import annotations

import pytest
from driver import FakeWorld, ProgramSpec, StepSpec
from scenario_steps import CPU, GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.events import ProgramEnded
from mori.core.ledger import ClusterSpec
from mori.core.policies import MoriPolicy
from mori.core.policy import Policy, PolicyConfig
from mori.core.types import Tier


def test_program_in_replica_2_cpu_tier_returns_to_replica_2() -> None:
    p = make("mori-paper", gpu=100, cpu=100, replicas=3)
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
    # goes to Uncached
    assert step(p, 5.0, fin("Q", 80)) == [Demote("Q", 2, GPU, NONE), Promote("P", 2, CPU),
                                          Forward("P", 2)]


def test_waiting_programs_packed_best_fit_decreasing_once_memory_binds() -> None:
    p = make("mori-paper", gpu=100, cpu=0, replicas=2)
    step(p, 0.0, arrive("A", 50))  # both empty: the most room, lowest index: replica 0
    step(p, 0.0, arrive("B", 70))  # fits only replica 1 (30 free)
    assert (where(p, "A"), where(p, "B")) == ((GPU, 0), (GPU, 1))
    # X 25, Y 25, Z 30 arrive at once (free: 50 and 30). Spreading (each, largest first,
    # onto the most room) would put Z on 0 and X on 1 and leave no room for Y: memory
    # binds, so they are packed. Best-Fit-Decreasing places Z first, exactly filling
    # replica 1, then X and Y on 0
    out = step(p, 1.0, arrive("X", 25), arrive("Y", 25), arrive("Z", 30))
    assert out == [Promote("Z", 1, NONE), Forward("Z", 1), Promote("X", 0, NONE),
                   Forward("X", 0), Promote("Y", 0, NONE), Forward("Y", 0)]
    assert [q.used for q in p.placement.gpu] == [100, 100]


def test_mori_uses_all_three_replicas_for_three_small_programs() -> None:
    p = make("mori-paper", gpu=100, cpu=100, replicas=3)
    for x in "ABC":
        step(p, 0.0, arrive(x, 10))
    assert sorted(where(p, x)[1] for x in "ABC") == [0, 1, 2]
    # arriving together: the largest first, each onto the replica with the most room
    q = make("mori-paper", gpu=100, cpu=100, replicas=3)
    assert step(q, 0.0, arrive("X", 10), arrive("Y", 30), arrive("Z", 20)) == [
        Promote("Y", 0, NONE), Forward("Y", 0), Promote("Z", 1, NONE), Forward("Z", 1),
        Promote("X", 2, NONE), Forward("X", 2)]


def test_mori_pack_keeps_the_papers_rule_and_leaves_two_replicas_idle() -> None:
    p = make("mori-pack", gpu=100, cpu=100, replicas=3)
    for x in "ABC":
        step(p, 0.0, arrive(x, 10))
    assert [where(p, x) for x in "ABC"] == [(GPU, 0)] * 3


def test_mori_spreads_to_the_replica_with_the_most_room() -> None:
    p = make("mori-paper", gpu=100, cpu=100, replicas=2)
    assert step(p, 0.0, arrive("A", 30)) == [Promote("A", 0, NONE), Forward("A", 0)]
    assert step(p, 0.0, arrive("B", 20)) == [Promote("B", 1, NONE), Forward("B", 1)]
    # replica 1 has 80 free against replica 0's 70
    assert step(p, 0.0, arrive("C", 10)) == [Promote("C", 1, NONE), Forward("C", 1)]
    step(p, 1.0, fin("A", 30))  # A acts: it still holds its place on replica 0
    # 70 free each: the lowest index
    assert step(p, 2.0, arrive("D", 10)) == [Promote("D", 0, NONE), Forward("D", 0)]


def test_mori_spreads_near_capacity_where_the_paper_packs() -> None:
    def two_replicas(policy: str) -> Policy:
        p = make(policy, gpu=100, cpu=100, replicas=2)
        step(p, 0.0, arrive("A", 60))  # replica 0
        step(p, 0.0, arrive("B", 60))  # replica 1
        step(p, 0.0, arrive("C", 10))  # mori: a tie (40 free each), replica 0
        return p

    # 145 of 200 in use with D: MORI puts D where the most room is left (replica 1, 40
    # free), so replica 0 (30 free) keeps room for A and C to grow
    assert step(two_replicas("mori-paper"), 1.0, arrive("D", 15)) == [Promote("D", 1, NONE),
                                                                 Forward("D", 1)]
    # the paper's Best-Fit-Decreasing puts C and then D onto replica 0, the tightest fit
    pack = two_replicas("mori-pack")
    assert where(pack, "C") == (GPU, 0)
    assert step(pack, 1.0, arrive("D", 15)) == [Promote("D", 0, NONE), Forward("D", 0)]


def test_best_fit_and_cpu_affinity() -> None:
    # packed placement (mori-pack; MORI itself spreads while memory does not bind)
    p = make("mori-pack", gpu=100, cpu=100, replicas=2)
    assert step(p, 0.0, arrive("A", 60)) == [Promote("A", 0, NONE), Forward("A", 0)]
    assert step(p, 0.0, arrive("B", 30)) == [Promote("B", 0, NONE), Forward("B", 0)]
    assert step(p, 0.0, arrive("C", 50)) == [Promote("C", 1, NONE), Forward("C", 1)]
    step(p, 1.0, fin("A", 60), fin("B", 30))
    # D (80) fits nowhere; replica 0 can be cleared (A, B acting at 4/5), replica 1 not
    assert step(p, 5.0, arrive("D", 80)) == [
        Demote("B", 0, GPU, CPU), Demote("A", 0, GPU, CPU), Promote("D", 0, NONE),
        Forward("D", 0)]
    # B returns: it reloads on its own replica only, though replica 1 has 50 free
    assert step(p, 6.0, arrive("B", 30)) == []
    assert where(p, "B") == (CPU, 0)
    # a new program goes wherever it fits
    assert step(p, 6.0, arrive("E", 40)) == [Promote("E", 1, NONE), Forward("E", 1)]


def test_smg_reroutes_returning_program_past_imbalance() -> None:
    p = make("smg", replicas=2)
    for i in range(6):  # balanced: p0 p2 p4 on replica 0, p1 p3 p5 on replica 1
        step(p, 0.0, arrive(f"p{i}", 10))
    for i in range(6):
        step(p, 1.0, fin(f"p{i}", 10))
    for i in (1, 3, 5):
        step(p, 2.0, ProgramEnded(f"p{i}"))
    assert [len(q.members) for q in p.placement.gpu] == [3, 0]
    # replica 0 carries 3 programs > 2.0 x max(1, 0): the docstring sends p0 to replica 1
    out = step(p, 3.0, arrive("p0", 20))
    assert out[-1] == Forward("p0", 1)


def test_smg_returning_program_goes_back_to_its_replica() -> None:
    p = make("smg", replicas=3)
    assert step(p, 0.0, arrive("a", 10), arrive("b", 10), arrive("c", 10)) == [
        Promote("a", 0, NONE), Forward("a", 0), Promote("b", 1, NONE), Forward("b", 1),
        Promote("c", 2, NONE), Forward("c", 2)]
    step(p, 1.0, fin("b", 10))
    assert step(p, 2.0, arrive("b", 15)) == [Forward("b", 1)]
    assert p.tick_interval is None


def test_spread_by_load_prefers_the_replica_serving_fewest_requests() -> None:
    p = make("mori-paper", gpu=100, cpu=100, replicas=3, spread_by_load=True)
    p.set_foreign_loads([4, 1, 0])  # the engines' reports (other clients' requests too)
    # all three empty of MORI's programs: replica 2 reports nothing running
    assert step(p, 0.0, arrive("A", 30)) == [Promote("A", 2, NONE), Forward("A", 2)]
    # A runs on 2: replicas 1 and 2 serve one request each; then the most room: 1
    p.set_foreign_loads([4, 1, 1])
    assert step(p, 0.0, arrive("B", 10)) == [Promote("B", 1, NONE), Forward("B", 1)]
    # arriving together, largest first, each counted as one more request where it goes:
    # Y (50) onto 2 (load 1), then X: 1 and 2 tie at 2 requests, 1 has more room
    p.set_foreign_loads([4, 2, 1])
    out = step(p, 1.0, arrive("X", 20), arrive("Y", 50))
    assert out == [Promote("Y", 2, NONE), Forward("Y", 2), Promote("X", 1, NONE),
                   Forward("X", 1)]
    # the least loaded among those it fits: Z (80) fits only replica 0, busy as it is
    p.set_foreign_loads([9, 0, 0])
    assert step(p, 2.0, arrive("Z", 80)) == [Promote("Z", 0, NONE), Forward("Z", 0)]


def test_spread_by_load_off_or_untold_is_the_most_room() -> None:
    for told, flag in ((True, False), (False, True)):
        p = make("mori-paper", gpu=100, cpu=100, replicas=2, spread_by_load=flag)
        step(p, 0.0, arrive("A", 30))
        if told:
            p.set_foreign_loads([0, 7])
        # replica 1 has the most room (100 against 70): loads are not weighed
        assert step(p, 0.0, arrive("B", 20)) == [Promote("B", 1, NONE), Forward("B", 1)]


def test_foreign_loads_are_checked() -> None:
    p = make("mori-paper", replicas=2, spread_by_load=True)
    for bad in ([1], [0, 0, 0], [0, -1]):
        with pytest.raises(ValueError):
            p.set_foreign_loads(bad)


def test_room_is_made_where_the_demoted_program_keeps_its_kv_in_dram() -> None:
    """Every GPU tier full: the room for a new program is made on the replica whose CPU
    tier can take the program demoted for it, not on the lowest index, which would push
    a program out of its full CPU tier to no tier while the other CPU tier sits empty."""
    p = make("mori-paper", gpu=100, cpu=100, replicas=2)
    step(p, 0.0, arrive("X", 90), arrive("Y", 90))
    assert (where(p, "X"), where(p, "Y")) == ((GPU, 0), (GPU, 1))
    step(p, 1.0, fin("X", 90), ProgramEnded("Y"))
    step(p, 2.0, arrive("A", 90))  # replica 1 is empty
    step(p, 2.0, arrive("C", 90))  # replica 0's X (acting) makes room: X to its DRAM
    assert (where(p, "A"), where(p, "C"), where(p, "X")) == ((GPU, 1), (GPU, 0), (CPU, 0))
    step(p, 3.0, fin("C", 90), fin("A", 90))
    # D needs room: both replicas have 10 free and one acting program. Replica 0's CPU
    # tier is full (X), replica 1's is empty: A moves to replica 1's DRAM and nobody
    # loses its KV
    assert step(p, 4.0, arrive("D", 80)) == [Demote("A", 1, GPU, CPU), Promote("D", 1, NONE),
                                             Forward("D", 1)]
    assert [where(p, x) for x in "ACDX"] == [(CPU, 1), (GPU, 0), (GPU, 1), (CPU, 0)]


def test_every_tier_full_both_replicas_take_new_programs_and_keep_dram_full() -> None:
    """200 programs of 100 tokens arrive one every 0.5 s, each makes one step and then
    sits in a long tool call; two replicas hold 10 such programs on each GPU and 10 in
    each CPU tier. Room for each newcomer is made on the replica whose most idle program
    is the most idle, so both replicas take new programs, and the demoted fill both CPU
    tiers before anyone is dropped: exactly the 160 that fit in no tier lose their KV.
    (Making room where the fewest must leave chose replica 0 for 190 of the 200, and
    dropped 170 while replica 1's CPU tier stayed empty.)"""
    progs = [ProgramSpec(f"p{i:03d}", i * 0.5, (StepSpec(growth=100, output=0, service=1.0,
                                                         gap=500.0, kv_frac=None),))
             for i in range(200)]
    policy = MoriPolicy(ClusterSpec(2, 1000, 1000), 1, PolicyConfig(page_tokens=1))
    world = FakeWorld(policy, progs, 10_000.0)
    world.run()
    admitted, to_cpu, dropped = [0, 0], [0, 0], 0
    for _, x in world.trace:
        for d in x if isinstance(x, list) else ():
            if isinstance(d, Promote) and d.source is Tier.NONE:
                admitted[d.replica] += 1
            elif isinstance(d, Demote) and d.source is Tier.GPU and d.to is Tier.CPU:
                to_cpu[d.replica] += 1
            elif isinstance(d, Demote) and d.to is Tier.NONE:
                dropped += 1
    assert min(admitted) >= 80, admitted
    assert min(to_cpu) >= 10, to_cpu
    assert dropped == 200 - 2 * 10 - 2 * 10
