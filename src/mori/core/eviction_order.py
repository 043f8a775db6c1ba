"""MORI's eviction order: which KV label an engine tier evicts first.

The one definition of the order by (tier, label). The simulator's KV pools
(``mori.sim.kvcache``), its admission order (``mori.sim.replica_model``), the vLLM
plug-in's typed free queue (GPU), CPU tier and disk tier, the label tables both
plug-ins share (``mori.plugin_channel.labels``) and the SGLang plug-in's radix-tree
order (``mori.sglang_plugin.order``) all derive their tables from this module;
tests/core/test_eviction_order.py checks that the orders they apply agree with it. It
plays the part of SGLang's ``EvictionStrategy.get_priority``: a rank, lower evicted
first, then least recently used within a rank.

The labels (``KVLabel``, set by the policy): ``busy`` (the program's KV belongs on the
GPU), ``idle`` (parked on the CPU tier), ``cold`` (parked on the replica's disk tier),
``inactive`` (on no tier: Uncached, dropped, or ended). A label that is not known (no
gateway, or a program it never labelled) counts as ``busy`` in the plug-ins, so they
evict as plain LRU until MORI says otherwise.

Each tier keeps longest what it is the right home for, and evicts first what another
tier holds or what nobody will reuse:

- **GPU**: ``inactive``, ``cold``, ``idle``, ``busy``. Inactive KV goes first (no tier
  wants it); cold next (its copy is on disk, MORI chose not to keep it on the faster
  tiers); idle then (its copy is on the CPU tier, and a reload from there is cheaper
  than from disk); busy last (the program runs, or returns, on this GPU).
- **CPU** (the host tier): ``inactive``, ``cold``, ``busy``, ``idle``. Cold goes right
  after inactive (the disk holds it), busy before idle: a busy program's KV is on the
  GPU as well, while an idle program's host copy is the one that saves its recompute.
- **Disk**: ``inactive``, ``busy``, ``idle``, ``cold``. Cold is kept longest: MORI
  parked the program here and the disk holds its only copy; busy and idle KV is on a
  faster tier too (busy on the GPU first, so it goes before idle).

Inactive is evicted first on every tier. A block shared by several programs takes the
most protective label of its programs on the tier that evicts it (the highest rank).

Admission (the simulator's waiting queue, under typed eviction) follows the GPU order
reversed: busy, idle, cold, inactive (the programs whose KV the GPU keeps longest are
admitted first).

Pure: no I/O, nothing beyond the standard library and ``mori.core.types`` (the vLLM and
SGLang plug-ins import it inside the engines' processes).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from mori.core.types import KVLabel, Tier

__all__ = [
    "ADMISSION_ORDER", "CPU_ORDER", "DISK_ORDER", "EVICTION_ORDER", "GPU_ORDER",
    "UNKEPT", "admission_rank", "eviction_order", "eviction_rank", "label_ranks",
    "most_protected", "ranks",
]

# each tier's labels, evicted first .. last
GPU_ORDER: tuple[KVLabel, ...] = (KVLabel.INACTIVE, KVLabel.COLD, KVLabel.IDLE, KVLabel.BUSY)
CPU_ORDER: tuple[KVLabel, ...] = (KVLabel.INACTIVE, KVLabel.COLD, KVLabel.BUSY, KVLabel.IDLE)
DISK_ORDER: tuple[KVLabel, ...] = (KVLabel.INACTIVE, KVLabel.BUSY, KVLabel.IDLE, KVLabel.COLD)

EVICTION_ORDER: Mapping[Tier, tuple[KVLabel, ...]] = MappingProxyType(
    {Tier.GPU: GPU_ORDER, Tier.CPU: CPU_ORDER, Tier.DISK: DISK_ORDER})

UNKEPT: KVLabel = KVLabel.INACTIVE
"""The label every tier evicts first: KV no tier keeps (the simulator writes none of it
to disk; the plug-ins start a block's most protective label from it, and a host tier
that only mirrors the GPU renews a program's chunks when it turns so)."""
assert all(order[0] is UNKEPT for order in EVICTION_ORDER.values())

# admitted first .. last: the GPU's order reversed
ADMISSION_ORDER: tuple[KVLabel, ...] = tuple(reversed(GPU_ORDER))

_RANKS: Mapping[Tier, Mapping[KVLabel, int]] = MappingProxyType({
    tier: MappingProxyType({label: i for i, label in enumerate(order)})
    for tier, order in EVICTION_ORDER.items()})
_ADMISSION: Mapping[KVLabel, int] = MappingProxyType(
    {label: i for i, label in enumerate(ADMISSION_ORDER)})


def eviction_order(tier: Tier) -> tuple[KVLabel, ...]:
    """``tier``'s labels, evicted first .. last (``Tier.GPU``, ``CPU`` or ``DISK``)."""
    return EVICTION_ORDER[tier]


def eviction_rank(tier: Tier, label: KVLabel) -> int:
    """``label``'s rank on ``tier``: 0 is evicted first, then 1, ..."""
    return _RANKS[tier][label]


def ranks(tier: Tier) -> dict[KVLabel, int]:
    """label -> rank on ``tier`` (a fresh dict: callers may keep it as a lookup table)."""
    return dict(_RANKS[tier])


def label_ranks(tier: Tier) -> dict[str, int]:
    """label name -> rank on ``tier`` (the plug-ins' string-keyed tables)."""
    return {label.value: rank for label, rank in _RANKS[tier].items()}


def most_protected(tier: Tier) -> KVLabel:
    """The label ``tier`` keeps longest."""
    return EVICTION_ORDER[tier][-1]


def admission_rank(label: KVLabel) -> int:
    """``label``'s place in the simulator's admission order: 0 is admitted first."""
    return _ADMISSION[label]
