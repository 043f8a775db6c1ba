"""Dynamo's workers as MORI's replicas: the slots, the capacities, the KV view by tier.

MORI's policy numbers its replicas 0..N-1 for the life of the process; Dynamo's workers
come and go as instances with 64-bit ids. ``WorkerSlots`` keeps N slots: each live worker
holds one, a worker that leaves Dynamo's discovery frees its slot (the replica is down:
its programs are placed again on the others), and a worker that joins takes a free slot
(the replica is up again, with an empty cache). Workers beyond N wait for a slot.

``capacity_of`` reads a worker's KV capacity from the model card it published (block size
times ``total_kv_blocks``; the native offloading capacity, where the engine publishes one,
as its host tier); ``TierOverlap`` reads ``KvRouter.get_overlap_scores``: how much of a
prompt each worker holds on device, on host and on disk. Nothing here imports Dynamo.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mori.engines.base import KVCapacity

NATIVE_OFFLOADING_KEY = "native_offloading_capacity"
"""Where a worker's card says how many tokens its engine's own host tier holds
(``runtime_config.runtime_data``), as Dynamo's SGLang worker publishes it."""


@dataclass(frozen=True, slots=True)
class SlotChange:
    """A slot whose worker changed: ``worker_id`` None when it left (the replica is
    down), else the worker that now holds it (the replica is up)."""

    slot: int
    worker_id: int | None
    previous: int | None


@dataclass(slots=True)
class WorkerSlots:
    """Which Dynamo worker serves each of MORI's ``size`` replicas. A worker counts as
    gone once it is missing from ``misses`` discovery readings in a row (a reading can
    miss a live worker while another registers)."""

    size: int
    misses: int = 3
    workers: list[int | None] = field(default_factory=list)
    _missing: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("the router needs at least one worker slot (--workers)")
        if not self.workers:
            self.workers = [None] * self.size

    def worker(self, slot: int) -> int | None:
        return self.workers[slot]

    def slot_of(self, worker_id: int) -> int | None:
        try:
            return self.workers.index(worker_id)
        except ValueError:
            return None

    @property
    def live(self) -> int:
        return sum(w is not None for w in self.workers)

    def update(self, live_ids: Iterable[int], failed: Iterable[int] = ()) -> list[SlotChange]:
        """Take a reading of the live workers; return the slots that changed. A slot's
        worker gone (``misses`` readings) frees it; new workers take free slots, the
        lowest id first (the same fleet maps the same way whatever order discovery lists
        it in), and then the slots of ``failed`` workers (their requests fail: a killed
        worker stays in discovery until its lease runs out)."""
        live = set(live_ids)
        changes: list[SlotChange] = []
        for slot, wid in enumerate(self.workers):
            if wid is None:
                continue
            if wid in live:
                self._missing.pop(wid, None)
                continue
            n = self._missing[wid] = self._missing.get(wid, 0) + 1
            if n >= self.misses:
                del self._missing[wid]
                self.workers[slot] = None
                changes.append(SlotChange(slot, None, wid))
        placed = {w for w in self.workers if w is not None}
        broken = [s for s, w in enumerate(self.workers) if w is not None and w in set(failed)]
        for wid in sorted(live - placed):
            if None in self.workers:
                slot = self.workers.index(None)
                previous = next((c.previous for c in changes if c.slot == slot), None)
            elif broken:
                slot = broken.pop(0)
                previous = self.workers[slot]
            else:
                break  # every slot is taken: the rest wait for one to free
            self.workers[slot] = wid
            changes.append(SlotChange(slot, wid, previous))
        return changes

    def unplaced(self, live_ids: Iterable[int]) -> list[int]:
        """Live workers without a slot (more workers than ``--workers``)."""
        return sorted(set(live_ids) - {w for w in self.workers if w is not None})


class CardError(ValueError):
    """A worker's model card does not say its KV capacity."""


def capacity_of(card: Mapping[str, Any], host_tokens: int | None = None) -> KVCapacity:
    """A worker's KV capacity from its model card. ``host_tokens``: the host tier's size
    when the operator gives it (``--host-tokens``); otherwise the card's native offloading
    capacity, where it has one, else none. Raises ``CardError``."""
    block = card.get("kv_cache_block_size")
    rc = card.get("runtime_config")
    blocks = rc.get("total_kv_blocks") if isinstance(rc, Mapping) else None
    if not isinstance(block, int) or block <= 0 or not isinstance(blocks, int) or blocks <= 0:
        raise CardError("the worker's model card gives no KV capacity (kv_cache_block_size "
                        f"={block!r}, runtime_config.total_kv_blocks={blocks!r}); start "
                        "the worker with its KV cache sized (the mocker: "
                        "--num-gpu-blocks-override) or give the router --gpu-tokens")
    if host_tokens is None:
        host_tokens = 0
        data = rc.get("runtime_data") if isinstance(rc, Mapping) else None
        native = data.get(NATIVE_OFFLOADING_KEY) if isinstance(data, Mapping) else None
        if isinstance(native, Mapping) and isinstance(native.get("total_tokens"), int):
            host_tokens = max(0, native["total_tokens"])
    return KVCapacity(gpu_tokens=block * blocks, cpu_tokens=host_tokens, page_tokens=block)


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """How many tokens of a prompt's prefix one worker holds: on its device, then beyond
    that on its host tier, then beyond that on its disk tier."""

    worker_id: int
    device_tokens: int
    host_tokens: int
    disk_tokens: int

    @property
    def cached_tokens(self) -> int:
        """The longest prefix it can serve without recomputing."""
        return self.device_tokens + self.host_tokens + self.disk_tokens


def tier_overlaps(scores: Mapping[str, Any]) -> dict[int, TierOverlap]:
    """Per worker, the tokens of the prompt it holds by tier, from
    ``KvRouter.get_overlap_scores``. Its rows count blocks of the prompt's prefix reachable
    through each tier, each tier's count including the tiers above it (``device_blocks``
    <= ``host_pinned_blocks`` <= ``disk_blocks``); here each tier gets what it adds.
    Rows it cannot read are left out; data-parallel ranks of one worker are summed."""
    block = scores.get("block_size")
    rows = scores.get("workers")
    if not isinstance(block, int) or block <= 0 or not isinstance(rows, list):
        return {}
    out: dict[int, TierOverlap] = {}

    def blocks(row: Mapping[str, Any], key: str) -> int:
        v = row.get(key)
        return v if isinstance(v, int) and v > 0 else 0

    for row in rows:
        if not isinstance(row, Mapping) or not isinstance(row.get("worker_id"), int):
            continue
        wid = row["worker_id"]
        dev = blocks(row, "device_blocks")
        host = max(dev, blocks(row, "host_pinned_blocks"))
        disk = max(host, blocks(row, "disk_blocks"))
        t = TierOverlap(wid, dev * block, (host - dev) * block, (disk - host) * block)
        seen = out.get(wid)
        if seen is not None:
            t = TierOverlap(wid, t.device_tokens + seen.device_tokens,
                            t.host_tokens + seen.host_tokens, t.disk_tokens + seen.disk_tokens)
        out[wid] = t
    return out


def active_requests(loads: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """Requests each worker is serving, from ``KvRouter.get_potential_loads`` (summed
    over its data-parallel ranks)."""
    out: dict[int, int] = {}
    for row in loads:
        wid, n = row.get("worker_id"), row.get("active_requests")
        if isinstance(wid, int) and isinstance(n, int):
            out[wid] = out.get(wid, 0) + n
    return out
