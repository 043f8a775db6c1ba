"""One eviction order (``mori.core.eviction_order``), and every component that applies it
agrees with it: for every tier and every label, the order each one actually evicts in
(or admits in) is the module's.

- the simulator's KV pools (GPU, CPU and disk) and its admission order;
- the label table both plug-ins share (a shared block's label on the GPU);
- the vLLM plug-in's typed free queue (GPU), CPU tier and disk tier (the last two need
  vLLM: run under its venv, ``tests/vllm_inside`` exercises their eviction);
- the SGLang plug-in's order on the GPU and on HiCache's host tier.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest

from mori.core import eviction_order as eo
from mori.core.types import KVLabel, Tier
from mori.plugin_channel.labels import PROTECTION, LabelTable
from mori.sglang_plugin import order as sglang_order
from mori.sim import replica_model
from mori.sim.kvcache import KVPools
from mori.vllm_plugin import typed_queue

TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
SIM_TIER = {Tier.GPU: "gpu", Tier.CPU: "cpu", Tier.DISK: "disk"}


def names(tier: Tier) -> list[str]:
    return [label.value for label in eo.eviction_order(tier)]


# -- the module itself ------------------------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
def test_each_tier_orders_every_label_once(tier: Tier) -> None:
    order = eo.eviction_order(tier)
    assert sorted(order) == sorted(KVLabel)
    assert [eo.eviction_rank(tier, label) for label in order] == list(range(len(KVLabel)))
    assert eo.ranks(tier) == {label: eo.eviction_rank(tier, label) for label in KVLabel}
    assert eo.label_ranks(tier) == {label.value: r for label, r in eo.ranks(tier).items()}
    assert eo.most_protected(tier) == order[-1]


def test_the_orders_stated_in_the_docstring() -> None:
    assert names(Tier.GPU) == ["inactive", "cold", "idle", "busy"]
    assert names(Tier.CPU) == ["inactive", "cold", "busy", "idle"]
    assert names(Tier.DISK) == ["inactive", "busy", "idle", "cold"]
    # admission: the GPU's order reversed
    assert sorted(KVLabel, key=eo.admission_rank) == [
        KVLabel.BUSY, KVLabel.IDLE, KVLabel.COLD, KVLabel.INACTIVE]


# -- the simulator ----------------------------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
def test_the_simulators_pools_evict_in_the_modules_order(tier: Tier) -> None:
    pools = KVPools(gpu_pages=100, cpu_pages=100, typed=True, disk_pages=100)
    # created in the reverse of the expected order: ties in creation order would not hide
    # a wrong rank
    for label in reversed(list(KVLabel)):
        e = pools.entry(label.value)
        e.gpu = e.cpu = e.disk = 1
        pools.set_label(e, label)
        pools.touch(e, 1.0)  # the same last access for all: the label alone decides
    order = [e.label for e in pools.eviction_order(SIM_TIER[tier])]
    assert order == list(eo.eviction_order(tier))


def test_the_simulators_admission_ranks_every_label_as_the_module() -> None:
    # (tests/sim/test_sim_engine.py admits a waiting request of each label in that order)
    table = replica_model._ADMISSION_RANK
    assert sorted(KVLabel, key=table.__getitem__) == sorted(KVLabel, key=eo.admission_rank)


# -- the label table both plug-ins use ---------------------------------------------------
def test_a_shared_gpu_blocks_label_is_the_most_protected_on_the_gpu() -> None:
    assert eo.label_ranks(Tier.GPU) == PROTECTION
    for a, b in itertools.combinations(KVLabel, 2):
        t = LabelTable()
        t.set_labels({"a": a.value, "b": b.value})
        t.learn("a", [1])
        t.learn("b", [1])
        best = max(a, b, key=lambda label: eo.eviction_rank(Tier.GPU, label))
        assert t.label_of_block(1) == best.value


# -- vLLM: the typed free queue (GPU) -----------------------------------------------------
@dataclass(eq=False)
class FakeBlock:
    block_id: int
    label: str
    block_hash: object | None = "h"
    prev_free_block: object = field(default=None, repr=False)
    next_free_block: object = field(default=None, repr=False)


def test_the_typed_queue_hands_out_blocks_in_the_modules_gpu_order() -> None:
    blocks = [FakeBlock(i, label.value) for i, label in enumerate(reversed(list(KVLabel)))]
    blocks.append(FakeBlock(len(blocks), "busy", block_hash=None))  # no hash: first of all
    q = typed_queue.TypedFreeBlockQueue(blocks, label_of=lambda b: b.label)
    out = [q.popleft() for _ in blocks]
    assert out[0].block_hash is None
    assert [b.label for b in out[1:]] == names(Tier.GPU)
    assert ("unhashed", *names(Tier.GPU)) == typed_queue.CLASS_NAMES
    for label in KVLabel:
        assert typed_queue.CLASS_NAMES[typed_queue.LABEL_CLASS[label.value]] == label.value


# -- vLLM: the CPU tier and the disk tier (need vLLM) --------------------------------------
@pytest.mark.parametrize(("module", "table", "tier"), [
    ("mori.vllm_plugin.cpu_tier", "CPU_PROTECTION", Tier.CPU),
    ("mori.vllm_plugin.disk_tier", "DISK_PROTECTION", Tier.DISK),
])
def test_the_vllm_tiers_rank_every_label_as_the_module(module: str, table: str,
                                                        tier: Tier) -> None:
    pytest.importorskip("vllm")
    import importlib
    m = importlib.import_module(module)
    assert getattr(m, table) == eo.label_ranks(tier)
    assert list(m.EVICT_ORDER) == names(tier)
    assert eo.most_protected(tier).value == m.WIDE_CLASS


# -- SGLang: the radix tree's order on the GPU and the host tier --------------------------
@pytest.mark.parametrize(("tier", "host"), [(Tier.GPU, False), (Tier.CPU, True)])
def test_sglangs_order_is_unowned_then_the_modules(tier: Tier, host: bool) -> None:
    labels = LabelTable()
    labels.set_labels({label.value: label.value for label in KVLabel})  # program = label
    nodes = {label.value: {label.value} for label in KVLabel} | {"unowned": set()}
    # the least recent last: only the class can put it first
    when = {n: float(-i) for i, n in enumerate(nodes)}
    order = sorted(nodes, key=lambda n: sglang_order.eviction_key(nodes[n], when[n],
                                                                  labels, host))
    assert order == ["unowned", *names(tier)]
    # a node shared by two labelled programs: the most protected of the two on the tier
    for a, b in itertools.combinations(KVLabel, 2):
        best = max(a, b, key=lambda label: eo.eviction_rank(tier, label))
        assert sglang_order.node_class({a.value, b.value}, labels, host) == best.value
    wide = {sglang_order.WIDE}
    assert sglang_order.node_class(wide, labels, host) == eo.most_protected(tier).value
