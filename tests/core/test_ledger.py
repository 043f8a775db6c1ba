"""Placement (tier ledgers) and ClusterSpec."""

from __future__ import annotations

import pytest

from mori.core.ledger import ClusterSpec, IntegrityError, Placement
from mori.core.types import Tier


def totals(pl: Placement) -> tuple[int, ...]:
    return (sum(pl.uncached.values()),
            *(q.used for q in pl.gpu), *(q.used for q in pl.cpu))


def make(replicas: int = 2, gpu: int | None = 100, cpu: int | None = 50) -> Placement:
    return Placement(ClusterSpec(replicas, gpu, cpu))


# -- ClusterSpec ---------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [0, -1])
def test_cluster_rejects_no_replicas(replicas: int) -> None:
    with pytest.raises(ValueError):
        ClusterSpec(replicas, 100, 100)


@pytest.mark.parametrize("gpu", [0, -5])
def test_cluster_rejects_non_positive_gpu(gpu: int) -> None:
    with pytest.raises(ValueError):
        ClusterSpec(1, gpu, 100)


def test_cluster_rejects_negative_cpu_accepts_zero_and_none() -> None:
    with pytest.raises(ValueError):
        ClusterSpec(1, 100, -1)
    assert ClusterSpec(1, 100, 0).cpu_bytes == 0
    assert ClusterSpec(3, None, None).gpu_bytes is None


# -- moves and resizes ----------------------------------------------------------------
def test_add_places_in_waiting() -> None:
    pl = make()
    pl.add("a", 10)
    assert pl.where("a") == (Tier.NONE, None)
    assert "a" in pl and len(pl) == 1
    assert pl.uncached == {"a": 10}
    with pytest.raises(ValueError):
        pl.add("a", 5)
    pl.check_integrity()


def test_moves_keep_totals() -> None:
    pl = make()
    pl.add("a", 30)
    pl.add("b", 20)
    pl.move("a", Tier.GPU, 1)
    assert totals(pl) == (20, 0, 30, 0, 0)
    assert pl.where("a") == (Tier.GPU, 1)
    pl.move("b", Tier.GPU, 1)
    assert totals(pl) == (0, 0, 50, 0, 0)
    pl.move("a", Tier.CPU, 1)
    assert totals(pl) == (0, 0, 20, 0, 30)
    assert pl.queue(Tier.CPU, 1) == {"a": 30}
    pl.move("a", Tier.GPU, 0)
    assert totals(pl) == (0, 30, 20, 0, 0)
    pl.move("b", Tier.NONE, None)
    assert totals(pl) == (20, 30, 0, 0, 0)
    assert pl.where("b") == (Tier.NONE, None)
    pl.check_integrity()
    assert sum(totals(pl)) == 50


def test_resize_in_place() -> None:
    pl = make()
    pl.add("a", 30)
    pl.resize("a", 35)
    assert pl.uncached == {"a": 35}
    pl.move("a", Tier.GPU, 0)
    pl.resize("a", 70)
    assert pl.where("a") == (Tier.GPU, 0)
    assert totals(pl) == (0, 70, 0, 0, 0)
    pl.move("a", Tier.CPU, 0)
    pl.resize("a", 10)
    assert totals(pl) == (0, 0, 0, 10, 0)
    pl.check_integrity()


def test_remove_frees() -> None:
    pl = make()
    pl.add("a", 30)
    pl.move("a", Tier.CPU, 0)
    pl.remove("a")
    assert "a" not in pl and len(pl) == 0
    assert totals(pl) == (0, 0, 0, 0, 0)
    pl.check_integrity()
    with pytest.raises(KeyError):
        pl.remove("a")


def test_bad_replica_rejected() -> None:
    for tier in (Tier.GPU, Tier.CPU):
        for r in (None, 2, -1):
            pl = make(replicas=2)
            pl.add("a", 1)
            with pytest.raises(ValueError):
                pl.move("a", tier, r)
    pl = make(replicas=2)
    pl.add("a", 1)
    pl.move("a", Tier.GPU, 1)
    assert pl.where("a") == (Tier.GPU, 1)


def test_failed_move_keeps_program() -> None:
    pl = make(replicas=2)
    pl.add("a", 7)
    with pytest.raises(ValueError):
        pl.move("a", Tier.GPU, 5)
    pl.check_integrity()
    assert pl.uncached == {"a": 7}


def test_capacity_none_is_unbounded() -> None:
    pl = make(replicas=1, gpu=None, cpu=0)
    pl.add("a", 10**12)
    pl.move("a", Tier.GPU, 0)
    assert pl.gpu[0].fits(10**12)
    assert pl.gpu[0].free() == float("inf")
    assert not pl.gpu[0].over()
    assert not pl.cpu[0].fits(1)
    pl.check_integrity()


def test_over_capacity_allowed_when_check_skips_it() -> None:
    pl = make(replicas=1, gpu=100, cpu=50)
    pl.add("a", 60)
    pl.add("b", 60)
    pl.move("a", Tier.GPU, 0)
    pl.move("b", Tier.GPU, 0)  # the ledger records it; deciding fixes it
    assert pl.gpu[0].over()
    pl.check_integrity(capacity=False)
    with pytest.raises(IntegrityError, match="over capacity"):
        pl.check_integrity()


def test_exactly_full_is_fine() -> None:
    pl = make(replicas=1, gpu=100, cpu=50)
    pl.add("a", 100)
    pl.move("a", Tier.GPU, 0)
    pl.add("b", 50)
    pl.move("b", Tier.CPU, 0)
    assert pl.gpu[0].free() == 0 and pl.cpu[0].free() == 0
    pl.check_integrity()


# -- corrupt states -------------------------------------------------------------------
def _placed() -> Placement:
    pl = make(replicas=2, gpu=100, cpu=50)
    pl.add("a", 40)
    pl.move("a", Tier.GPU, 0)
    pl.add("b", 20)
    pl.move("b", Tier.CPU, 1)
    pl.add("c", 10)
    pl.check_integrity()
    return pl


def test_catches_cpu_over_capacity() -> None:
    pl = _placed()
    pl.resize("b", 51)
    with pytest.raises(IntegrityError, match="over capacity"):
        pl.check_integrity()


def test_catches_gpu_over_capacity_by_poking() -> None:
    pl = _placed()
    pl.gpu[0].members["a"] = 101
    pl.gpu[0].used = 101
    with pytest.raises(IntegrityError, match="over capacity"):
        pl.check_integrity()


def test_catches_double_membership_gpu_and_cpu() -> None:
    pl = _placed()
    pl.cpu[0].members["a"] = 40
    pl.cpu[0].used += 40
    with pytest.raises(IntegrityError, match="'a'"):
        pl.check_integrity()


def test_catches_double_membership_waiting_and_gpu() -> None:
    pl = _placed()
    pl.gpu[1].members["c"] = 10
    pl.gpu[1].used += 10
    with pytest.raises(IntegrityError, match="'c'"):
        pl.check_integrity()


def test_catches_double_membership_across_replicas() -> None:
    pl = _placed()
    pl.gpu[1].members["a"] = 40
    pl.gpu[1].used += 40
    with pytest.raises(IntegrityError):
        pl.check_integrity()


def test_catches_used_mismatch() -> None:
    pl = _placed()
    pl.gpu[0].used -= 1
    with pytest.raises(IntegrityError, match="used"):
        pl.check_integrity()


def test_catches_index_disagreement() -> None:
    pl = _placed()
    pl._where["a"] = (Tier.GPU, 1)  # the queues say replica 0
    with pytest.raises(IntegrityError, match="index"):
        pl.check_integrity()
    pl = _placed()
    del pl.uncached["c"]  # indexed but in no queue
    with pytest.raises(IntegrityError):
        pl.check_integrity()
    pl = _placed()
    pl.uncached["ghost"] = 3  # in a queue but not indexed
    with pytest.raises(IntegrityError):
        pl.check_integrity()
