"""MORI's disk tier (``mori_disk``) in hand-worked scenarios.

Capacities in tokens (1 byte each). ``recompute_tok_s=10``: a 60-token context takes
6 s to recompute; a read from disk takes ``disk_latency_s`` plus 1 ns a byte (60 ns
for 60 bytes), 2 s unless a test says otherwise: a program may leave for the disk a
little after 2 s away, checked at 2.1 s.
"""

from __future__ import annotations

import pytest
from scenario_steps import CPU, DISK, GPU, NONE, arrive, fin, make, step, where

from mori.core.decisions import Demote, Forward, Promote
from mori.core.events import ReplicaDown, ReplicaUp
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES
from mori.core.policy import PolicyConfig

RATE = {"recompute_tok_s": 10.0, "disk_read_gbps": 1.0, "disk_latency_s": 2.0}


def test_a_program_leaves_for_disk_once_away_as_long_as_its_read_back() -> None:
    """No CPU tier: A leaves the GPU for B once its tool call has lasted its read from
    disk (2 s), not its recompute (6 s); its return reads it back on the same replica."""
    p = make("mori", gpu=100, cpu=0, disk=200, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 2.0, arrive("B", 60)) == []
    assert step(p, 3.0) == []
    assert step(p, 3.1) == [Demote("A", 0, GPU, DISK), Promote("B", 0, NONE),
                            Forward("B", 0)]
    assert where(p, "A") == (DISK, 0)
    step(p, 4.0, fin("B", 60))
    assert step(p, 5.0, arrive("A", 70)) == []  # A (grown) waits for B's read price
    assert where(p, "A") == (DISK, 0) and p.placement.disk[0].used == 70
    assert step(p, 6.1) == [Demote("B", 0, GPU, DISK), Promote("A", 0, DISK),
                            Forward("A", 0)]


def test_without_a_disk_tier_the_same_program_waits_for_its_drop_to_pay() -> None:
    p = make("mori", gpu=100, cpu=0, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 2.0, arrive("B", 60)) == []
    assert step(p, 6.9) == []
    assert step(p, 7.0) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                            Forward("B", 0)]


def test_a_disk_that_reads_slower_than_a_recompute_is_not_written() -> None:
    """A read of 7 s against a recompute of 6 s: A is dropped, as with no disk."""
    p = make("mori", gpu=100, cpu=0, disk=200, **{**RATE, "disk_latency_s": 7.0})
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 2.0, arrive("B", 60)) == []
    assert step(p, 7.0) == [Demote("A", 0, GPU, NONE), Promote("B", 0, NONE),
                            Forward("B", 0)]
    assert p.placement.disk[0].used == 0


def test_the_cpu_tier_fills_before_the_disk() -> None:
    """Room in the CPU tier: A parks there at once (a reload costs no GPU time)."""
    p = make("mori", gpu=100, cpu=100, disk=200, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    assert step(p, 1.5, arrive("B", 60)) == [Demote("A", 0, GPU, CPU),
                                             Promote("B", 0, NONE), Forward("B", 0)]


def test_pushed_out_of_a_full_cpu_tier_a_program_goes_to_disk() -> None:
    """A small CPU tier (60 of 100): C parked, A's drop pays at t = 8; C is pushed out
    of the CPU tier for A, to the disk instead of to no tier."""
    p = make("mori", gpu=100, cpu=60, disk=200, **{**RATE, "disk_latency_s": 50.0,
                                                     "recompute_tok_s": 10.0})
    step(p, 0.0, arrive("C", 60))
    step(p, 1.0, fin("C", 60))
    step(p, 1.0, arrive("A", 60))
    assert where(p, "C") == (CPU, 0)
    step(p, 2.0, fin("A", 60))
    step(p, 3.0, arrive("B", 60))
    out = step(p, 8.0)
    # a 50 s read does not pay against a 6 s recompute: C is dropped, not written
    assert out == [Demote("C", 0, CPU, NONE), Demote("A", 0, GPU, CPU),
                   Promote("B", 0, NONE), Forward("B", 0)]
    q = make("mori", gpu=100, cpu=60, disk=200, **RATE)
    step(q, 0.0, arrive("C", 60))
    step(q, 1.0, fin("C", 60))
    step(q, 1.0, arrive("A", 60))
    step(q, 2.0, fin("A", 60))
    # A may leave at t = 4 (away 2 s: its read from disk); it parks in the CPU tier,
    # pushing C (more idle) to the disk
    assert step(q, 3.0, arrive("B", 60)) == []
    assert step(q, 4.1) == [Demote("C", 0, CPU, DISK), Demote("A", 0, GPU, CPU),
                            Promote("B", 0, NONE), Forward("B", 0)]


def test_a_full_disk_pushes_out_the_more_idle_program() -> None:
    """The disk holds one program. X (idleness 0.9 at t = 10) is on it; Y (0.81) must
    leave the GPU for Z: X goes to no tier, Y to the disk."""
    p = make("mori", gpu=100, cpu=0, disk=60, **RATE)
    step(p, 0.0, arrive("X", 60))
    step(p, 1.0, fin("X", 60))
    step(p, 2.0, arrive("Y", 60))
    assert step(p, 3.1) == [Demote("X", 0, GPU, DISK), Promote("Y", 0, NONE),
                            Forward("Y", 0)]
    step(p, 4.5, fin("Y", 60))
    assert step(p, 10.0, arrive("Z", 60)) == [
        Demote("X", 0, DISK, NONE), Demote("Y", 0, GPU, DISK), Promote("Z", 0, NONE),
        Forward("Z", 0)]


def test_a_less_idle_program_on_disk_stays_and_the_leaving_one_waits_for_its_drop() -> None:
    """The disk holds Y, busier than X: X cannot push it out, so X leaves the GPU only
    once its own drop pays (6 s away), to no tier. (Y is the program X makes room for,
    and leaves the disk in the same round; its room is not counted as free for X: a
    round that could not place Y after all would leave the disk over capacity.)"""
    p = make("mori", gpu=100, cpu=0, disk=60, **RATE)
    step(p, 0.0, arrive("Y", 60))
    step(p, 5.0, fin("Y", 60))  # Y: a long step, then a tool call
    step(p, 5.0, arrive("X", 60))
    assert step(p, 7.1) == [Demote("Y", 0, GPU, DISK), Promote("X", 0, NONE),
                            Forward("X", 0)]
    step(p, 7.5, fin("X", 60))  # X: a short step, then a tool call
    assert step(p, 8.0, arrive("Y", 60)) == []  # Y (idleness 0.375) waits
    assert step(p, 13.4) == []  # X (0.84 at 9.6) may not push Y off the disk
    assert step(p, 13.5) == [Demote("X", 0, GPU, NONE), Promote("Y", 0, DISK),
                             Forward("Y", 0)]


def test_a_program_on_disk_goes_back_to_its_own_replica() -> None:
    """A, on replica 0's disk, waits for replica 0 (affinity: its KV is there), though
    F on replica 1 could leave for it; when R on replica 0 may leave, A reads back there.
    R pushes nobody off the disk: A's request is held."""
    p = make("mori", gpu=100, cpu=0, disk=200, replicas=2, **RATE)
    step(p, 0.0, arrive("A", 60))
    assert where(p, "A") == (GPU, 0)
    step(p, 0.0, arrive("F", 60))  # F fills replica 1
    assert where(p, "F") == (GPU, 1)
    step(p, 1.0, fin("A", 60))
    step(p, 2.0, arrive("R", 60))
    assert step(p, 3.1) == [Demote("A", 0, GPU, DISK), Promote("R", 0, NONE),
                            Forward("R", 0)]
    step(p, 4.0, fin("F", 60))
    assert step(p, 5.0, arrive("A", 60)) == []
    assert step(p, 6.1) == []  # F may leave replica 1 now, but A waits for replica 0
    step(p, 7.0, fin("R", 60))
    assert step(p, 9.1) == [Demote("R", 0, GPU, DISK), Promote("A", 0, DISK),
                            Forward("A", 0)]


def test_a_held_program_is_not_pushed_off_the_disk() -> None:
    """The disk holds A (held, more idle than R): R, leaving the GPU for A, may not push
    A off the disk; it leaves only once its own drop pays, to no tier."""
    p = make("mori", gpu=100, cpu=0, disk=60, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    step(p, 2.0, arrive("R", 60))
    assert step(p, 3.1) == [Demote("A", 0, GPU, DISK), Promote("R", 0, NONE),
                            Forward("R", 0)]
    step(p, 4.0, fin("R", 60))
    step(p, 5.0, arrive("A", 60))  # A: idleness 0.8; R: 1 s away of 2 s
    assert step(p, 9.9) == []
    assert step(p, 10.0) == [Demote("R", 0, GPU, NONE), Promote("A", 0, DISK),
                             Forward("A", 0)]


def test_a_replica_that_goes_down_loses_its_disk_queue() -> None:
    p = make("mori", gpu=100, cpu=0, disk=100, **RATE)
    step(p, 0.0, arrive("A", 60))
    step(p, 1.0, fin("A", 60))
    step(p, 2.0, arrive("B", 60))
    step(p, 3.1)
    assert where(p, "A") == (DISK, 0)
    step(p, 4.0, ReplicaDown(0))
    assert where(p, "A") == (NONE, None) and p.placement.disk[0].capacity == 0
    step(p, 5.0, ReplicaUp(0))
    assert p.placement.disk[0].capacity == 100


@pytest.mark.parametrize("name", [n for n in POLICIES.names() if not n.startswith("mori")])
def test_policies_without_a_disk_queue_schedule_no_disk(name: str) -> None:
    p = POLICIES.get(name)(ClusterSpec(1, 100, 100, 500), 1, PolicyConfig(page_tokens=1))
    assert p.cluster.disk_bytes == 0 and p.placement.disk[0].capacity == 0


def test_return_cost_of_a_program_on_disk_is_its_read() -> None:
    p = make("mori", gpu=100, cpu=0, disk=100, **RATE)
    step(p, 0.0, arrive("A", 60))
    a = p.programs["A"]
    assert p.return_cost(a, DISK, 0, 0.0) == pytest.approx(2.0 + 60 / 1e9)
    assert p.return_cost(a, NONE, 0, 0.0) == pytest.approx(6.0)
