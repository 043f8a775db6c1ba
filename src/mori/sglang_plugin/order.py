"""The order in which the SGLang plug-in evicts radix-tree nodes (no SGLang needed).

A node's *owners* are the programs whose requests inserted or matched it (the gateway
names a request's program in the ``x-smg-routing-key`` header, which SGLang keeps as the
request's ``routing_key``; the value is percent-encoded, :func:`routing_key`). A node
owned by more than :data:`MAX_OWNERS` programs is *widely shared* and counts as
the tier's most protected label (busy on the GPU, idle on the host: which owner runs
next is anyone's guess). Its class, on each tier:

- no owner (a request that did not come through the gateway): ``unowned``;
- else the most protective label of its owners on that tier (a program the gateway has
  not labelled is ``busy``, as in the vLLM plug-in).

Eviction takes the smallest key first: ``(class rank, last access time)``. ``unowned``
ranks 0, below every label (a plug-in-local class); the labels follow, in the tier's
order of ``mori.core.eviction_order`` from 1 (the GPU's order on the device, the CPU
tier's on HiCache's host tier; that module says why each tier keeps what it keeps).
While no label is
known (no gateway has spoken, or it cleared the table) every node has rank 0: SGLang's
own LRU, exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import quote, unquote

from mori.core.eviction_order import label_ranks, most_protected
from mori.core.types import Tier
from mori.plugin_channel.labels import LabelTable

MAX_OWNERS = 64
ROUTING_HEADER = "x-smg-routing-key"
UNOWNED = "unowned"  # no program owns the node: evicted before every label
# class -> rank, lowest evicted first: unowned, then the labels in the tier's order
DEVICE_RANK = {UNOWNED: 0} | {n: 1 + r for n, r in label_ranks(Tier.GPU).items()}
HOST_RANK = {UNOWNED: 0} | {n: 1 + r for n, r in label_ranks(Tier.CPU).items()}
DEVICE_WIDE = most_protected(Tier.GPU).value  # the class of a widely shared node
HOST_WIDE = most_protected(Tier.CPU).value
WIDE = "\x00wide"  # the owner set of a widely shared node holds only this mark


def routing_key(program_id: str) -> str:
    """The header value naming ``program_id`` (percent-encoded: any id fits a header)."""
    return quote(program_id, safe="")


def program_of(key: object) -> str | None:
    """The program a request's ``routing_key`` names, or ``None`` when it has none."""
    if not isinstance(key, str) or not key:
        return None
    return unquote(key)


def add_owner(owners: set[str], program: str) -> None:
    """Add ``program`` to a node's owners, marking the node widely shared past
    :data:`MAX_OWNERS`."""
    if WIDE in owners or program in owners:
        return
    if len(owners) >= MAX_OWNERS:
        owners.clear()
        owners.add(WIDE)
        return
    owners.add(program)


def node_class(owners: Iterable[str], labels: LabelTable, host: bool = False) -> str:
    """``unowned``, or the most protective label of ``owners`` on the GPU (on the host
    tier with ``host``; module doc)."""
    ranks, top = (HOST_RANK, HOST_WIDE) if host else (DEVICE_RANK, DEVICE_WIDE)
    best = UNOWNED
    for program in owners:
        if program == WIDE:
            return top
        label = labels.label(program)
        if ranks[label] > ranks[best]:
            best = label
            if label == top:
                break
    return best


def eviction_key(owners: Iterable[str], last_access: float, labels: LabelTable,
                 host: bool = False) -> tuple[int, float]:
    """The key SGLang's eviction heap orders nodes by (smallest evicted first)."""
    if len(labels) == 0:
        return (0, last_access)
    ranks = HOST_RANK if host else DEVICE_RANK
    return (ranks[node_class(owners, labels, host)], last_access)
