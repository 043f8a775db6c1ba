"""KV residency of one engine replica: a GPU pool, a CPU pool and a disk pool of pages.

A program's cached KV is a prefix of its context (block hashes are chained, and a
radix-tree or paged cache evicts from the leaves, i.e. the tail). So per program we keep
``gpu`` pages (the prefix on the GPU) and ``cpu`` pages (the pages right after it, held
only on the CPU), then ``disk`` pages (the pages after those, held only on the replica's
disk, when it has a disk tier). All pages of a program are touched together by each request, so LRU at
program granularity equals page-level LRU here.

The CPU pool is *exclusive*: it counts only pages not on the GPU. With write-through the
engine's host pool also mirrors what is on the GPU, so ``cpu_pages`` here is the host
pool minus the mirror of a full GPU pool; evicting a page from the GPU moves it to the CPU
at no transfer cost (its copy was written while it was computed). Only GPU pages whose KV
has been computed have that copy: a page reserved for KV not computed yet (the rest of a
running request's prompt, its output) or free has none, and until it is written the host
pool's room for it holds CPU-only pages. So the CPU pool holds up to ``cpu_room()``:
``cpu_pages`` plus the GPU pages free or reserved (``unmirrored``), and pages evicted from
it when reserved pages are written (``written``), as the engine's host tier evicts when it
stores a newly computed block. The host tier then holds at most ``cpu_pages`` + the GPU
pool, whatever the GPU reserves (measured on vLLM's offloading connector: a 16,384-token
host tier keeps the last 16,384 tokens computed, docs/costmodel.md).

The disk pool sits under the CPU pool: pages evicted from the CPU pool are written to
disk (a write the replica charges on its disk link, ``disk_written``) instead of being
lost, except those labelled inactive; pages evicted from the disk pool are lost. With no
CPU pool, pages evicted from the GPU go to disk directly (through a host buffer).

Eviction order: with ``typed`` (MORI), by type label first, in each tier's order of
``mori.core.eviction_order`` (one order per tier, read from there), then least recently
used; otherwise plain LRU.
Pinned programs (a request running) are never evicted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from heapq import heapify, heappop, heappush

from mori.core.eviction_order import UNKEPT, ranks
from mori.core.types import KVLabel, Tier

_GPU_RANK = ranks(Tier.GPU)
_CPU_RANK = ranks(Tier.CPU)
_DISK_RANK = ranks(Tier.DISK)
_NO_RANK = dict.fromkeys(KVLabel, 0)  # plain LRU

# an eviction-order record: (tier rank, last access, entry seq, entry version, entry)
_Record = tuple[int, float, int, int, "KVEntry"]


@dataclass(slots=True)
class KVEntry:
    """One program's pages on one replica. ``label``, ``last_access`` and ``pinned``
    set its place in the eviction order, so they change only through ``KVPools``
    (``set_label``, ``touch``, ``pin``, ``unpin``), which keeps that order current."""

    program_id: str
    seq: int = 0  # creation order among the pool's entries (ties in the eviction order)
    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    reserved: int = 0  # of the GPU pages, those reserved for KV not computed yet
    ended: bool = False  # the program is gone; drop the entry once it holds nothing
    _label: KVLabel = KVLabel.BUSY
    _last_access: float = 0.0
    _pinned: bool = False
    _ver: int = 0  # bumped at each change of place: older records are stale

    @property
    def label(self) -> KVLabel:
        return self._label

    @property
    def last_access(self) -> float:
        return self._last_access

    @property
    def pinned(self) -> bool:
        return self._pinned


class KVPools:
    """Page accounting and eviction for one replica."""

    def __init__(self, gpu_pages: int, cpu_pages: int, typed: bool,
                 disk_pages: int = 0) -> None:
        if gpu_pages <= 0:
            raise ValueError(f"GPU pool must hold at least one page, got {gpu_pages}")
        self.gpu_cap = gpu_pages
        self.cpu_cap = max(0, cpu_pages)
        self.disk_cap = max(0, disk_pages)
        self.typed = typed
        self.gpu_used = 0
        self.cpu_used = 0
        self.unmirrored = 0  # GPU pages reserved for KV not computed yet (no host copy)
        self.disk_used = 0
        self.entries: dict[str, KVEntry] = {}
        # entries that lost pages or ended since the last sweep: the only ones a sweep
        # can find empty and ended (instead of looking at every entry)
        self._maybe_dead: list[KVEntry] = []
        # each tier's evictable entries, first to evict first, as heaps of records
        # pushed at every change of an entry's place; a record is stale (passed over
        # and dropped) once its entry has a newer version, is pinned, or holds no page
        # in that tier. The order is the one a sort of every entry by (rank, last
        # access) would give, ties in creation order (the entries' dict order).
        self._gpu_rank = _GPU_RANK if typed else _NO_RANK
        self._cpu_rank = _CPU_RANK if typed else _NO_RANK
        self._disk_rank = _DISK_RANK if typed else _NO_RANK
        self._gpu_heap: list[_Record] = []
        self._cpu_heap: list[_Record] = []
        self._disk_heap: list[_Record] = []
        self._created = 0
        self.evicted_gpu_pages = 0
        self.dropped_pages = 0
        self.disk_written = 0  # pages written to the disk pool, in all
        self.disk_write_backlog = 0  # of those, pages the replica has not charged yet

    def entry(self, program_id: str) -> KVEntry:
        e = self.entries.get(program_id)
        if e is None:
            self._created += 1
            e = KVEntry(program_id, self._created)
            self.entries[program_id] = e
        return e

    # -- an entry's place in the eviction order ----------------------------------------
    def set_label(self, e: KVEntry, label: KVLabel) -> None:
        if label is not e._label:
            e._label = label
            self._push(e)

    def touch(self, e: KVEntry, now: float) -> None:
        """``e`` was used at ``now`` (its last access)."""
        if now != e._last_access:
            e._last_access = now
            self._push(e)

    def pin(self, e: KVEntry) -> None:
        """A request is running on ``e``'s pages: never evict them until ``unpin``."""
        e._pinned = True

    def unpin(self, e: KVEntry, now: float | None = None) -> None:
        """The request is over (used at ``now``, if given): what it reserved is written."""
        if e.reserved:
            self.written(e, e.reserved)
        e._pinned = False
        if now is not None:
            e._last_access = now
        self._push(e)

    def _push(self, e: KVEntry) -> None:
        e._ver += 1
        if e._pinned:
            return
        if e.gpu > 0:
            heap = self._gpu_heap
            heappush(heap, (self._gpu_rank[e._label], e._last_access, e.seq, e._ver, e))
            if len(heap) > 2 * len(self.entries) + 64:
                self._gpu_heap = self._compact(heap, "gpu")
        if e.cpu > 0:
            heap = self._cpu_heap
            heappush(heap, (self._cpu_rank[e._label], e._last_access, e.seq, e._ver, e))
            if len(heap) > 2 * len(self.entries) + 64:
                self._cpu_heap = self._compact(heap, "cpu")
        if e.disk > 0:
            heap = self._disk_heap
            heappush(heap, (self._disk_rank[e._label], e._last_access, e.seq, e._ver, e))
            if len(heap) > 2 * len(self.entries) + 64:
                self._disk_heap = self._compact(heap, "disk")

    @staticmethod
    def _pages(e: KVEntry, tier: str) -> int:
        return e.gpu if tier == "gpu" else e.cpu if tier == "cpu" else e.disk

    @staticmethod
    def _compact(heap: list[_Record], tier: str) -> list[_Record]:
        live = [r for r in heap if r[3] == r[4]._ver and not r[4]._pinned
                and KVPools._pages(r[4], tier) > 0]
        heapify(live)
        return live

    def cpu_room(self) -> int:
        """Pages the CPU pool may hold now: ``cpu_cap`` plus the host tier's room for the
        GPU pages that have no copy there (free, or reserved for KV not computed yet);
        0 without a CPU pool."""
        if self.cpu_cap == 0:
            return 0
        return self.cpu_cap + self.gpu_cap - self.gpu_used + self.unmirrored

    def written(self, e: KVEntry, pages: int) -> None:
        """``pages`` of the GPU pages ``e`` reserved (``take_for_request``) now hold
        computed KV, written through to the host tier: the CPU pool gives up their room,
        evicting as the host tier does when it stores a computed block."""
        if not 0 <= pages <= e.reserved:
            raise ValueError(f"{pages} pages written, {e.reserved} reserved")
        e.reserved -= pages
        self.unmirrored -= pages
        self._fit_cpu()

    def _unreserve(self, e: KVEntry) -> None:
        """``e`` lost GPU pages: the reserved ones go first (they are its tail)."""
        if e.reserved > e.gpu:
            self.unmirrored -= e.reserved - e.gpu
            e.reserved = e.gpu

    def _fit_cpu(self) -> None:
        over = self.cpu_used - self.cpu_room()
        if over > 0:
            self._shrink_cpu(over)

    def gpu_free(self) -> int:
        return self.gpu_cap - self.gpu_used

    # -- changes ---------------------------------------------------------------------
    def truncate(self, e: KVEntry, valid_pages: int) -> None:
        """Forget pages past ``valid_pages`` (a context that changed: stale branch)."""
        keep_gpu = min(e.gpu, valid_pages)
        keep_cpu = min(e.cpu, max(0, valid_pages - keep_gpu))
        keep_disk = min(e.disk, max(0, valid_pages - keep_gpu - keep_cpu))
        self.gpu_used -= e.gpu - keep_gpu
        self.cpu_used -= e.cpu - keep_cpu
        self.disk_used -= e.disk - keep_disk
        if (keep_gpu, keep_cpu, keep_disk) != (e.gpu, e.cpu, e.disk):
            self._track(e)
        e.gpu, e.cpu, e.disk = keep_gpu, keep_cpu, keep_disk
        self._unreserve(e)

    def end(self, e: KVEntry) -> None:
        """Mark ``e``'s program as gone: the entry is dropped once it holds nothing."""
        e.ended = True
        self._track(e)

    def _track(self, e: KVEntry) -> None:
        self._maybe_dead.append(e)
        if len(self._maybe_dead) > 2 * len(self.entries) + 64:  # no sweep for long
            self._maybe_dead = list({id(x): x for x in self._maybe_dead}.values())

    def make_gpu_room(self, pages: int, now: float) -> bool:
        """Evict unpinned pages until ``pages`` are free on the GPU; False if impossible."""
        if self.gpu_free() >= pages:
            return True
        for e in self._victims("gpu"):
            short = pages - self.gpu_free()
            if short <= 0:
                break
            self._evict_gpu(e, min(short, e.gpu), now)
        self._sweep()
        return self.gpu_free() >= pages

    def evict_program_gpu(self, program_id: str, now: float) -> None:
        """Push all of a program's GPU pages out (to the CPU pool if there is one)."""
        e = self.entries.get(program_id)
        if e is not None and e.gpu and not e.pinned:
            self._evict_gpu(e, e.gpu, now)

    def _evict_gpu(self, e: KVEntry, n: int, now: float) -> None:
        """Move the last ``n`` GPU pages of ``e`` to the CPU pool (or drop them)."""
        self.evicted_gpu_pages += n
        self.gpu_used -= n
        e.gpu -= n
        self._unreserve(e)
        self._track(e)
        if self.cpu_cap == 0:
            self.dropped_pages += e.cpu
            self.cpu_used -= e.cpu
            e.cpu = 0
            self._to_disk(e, n)
            return
        # the moved pages sit right before e's CPU-only pages
        e.cpu += n
        self.cpu_used += n
        self._push(e)  # now evictable from the CPU
        room = self.cpu_room()
        if self.cpu_used > room:
            self._shrink_cpu(self.cpu_used - room)
        if self.cpu_used > room:  # only pinned pages left to drop: lose these
            lose = min(e.cpu, self.cpu_used - room)
            e.cpu -= lose
            self.cpu_used -= lose
            self.dropped_pages += lose

    def _shrink_cpu(self, pages: int) -> None:
        for e in self._victims("cpu"):
            if pages <= 0:
                break
            n = min(pages, e.cpu)
            e.cpu -= n
            self._track(e)
            self.cpu_used -= n
            pages -= n
            self._to_disk(e, n)
        self._sweep()

    def _to_disk(self, e: KVEntry, n: int) -> None:
        """``n`` pages evicted from ``e``'s host copy: written to disk, where there is a
        disk pool and ``e`` is not inactive, placed right before its disk-only pages;
        else lost (with the disk-only pages after them: a prefix must stay whole)."""
        if n <= 0:
            return
        if self.disk_cap == 0 or (self.typed and e._label is UNKEPT):
            self.dropped_pages += n + e.disk
            self.disk_used -= e.disk
            e.disk = 0
            return
        e.disk += n
        self.disk_used += n
        self.disk_written += n
        self.disk_write_backlog += n
        self._push(e)  # now evictable from the disk
        if self.disk_used > self.disk_cap:
            self._shrink_disk(self.disk_used - self.disk_cap)
        if self.disk_used > self.disk_cap:  # only pinned pages left to drop: lose these
            lose = min(e.disk, self.disk_used - self.disk_cap)
            e.disk -= lose
            self.disk_used -= lose
            self.dropped_pages += lose

    def _shrink_disk(self, pages: int) -> None:
        for e in self._victims("disk"):
            if pages <= 0:
                break
            n = min(pages, e.disk)
            e.disk -= n
            self._track(e)
            self.disk_used -= n
            self.dropped_pages += n
            pages -= n

    def _victims(self, tier: str) -> Iterator[KVEntry]:
        """The entries holding pages in a tier ("gpu", "cpu", "disk"), first to evict
        first, as the caller evicts: each is given while it heads the order, so the
        caller must take all its pages in the tier or stop (a partly evicted entry would
        be given again)."""
        while True:
            heap = self._heap(tier)  # (a push may compact it)
            if not heap:
                return
            _, _, _, ver, e = heap[0]
            if ver != e._ver or e._pinned or self._pages(e, tier) <= 0:
                heappop(heap)  # stale
                continue
            yield e

    def _heap(self, tier: str) -> list[_Record]:
        return (self._gpu_heap if tier == "gpu" else self._cpu_heap if tier == "cpu"
                else self._disk_heap)

    def eviction_order(self, gpu: bool | str) -> list[KVEntry]:
        """The entries holding pages in a tier, first to evict first (read only):
        ``gpu`` True or "gpu", False or "cpu", or "disk"."""
        tier = ("gpu" if gpu else "cpu") if isinstance(gpu, bool) else gpu
        return [r[4] for r in sorted(self._compact(self._heap(tier), tier))]

    def _sweep(self) -> None:
        """Drop the entries of ended programs that hold no page."""
        maybe, self._maybe_dead = self._maybe_dead, []
        for e in maybe:
            if (e.ended and not e.gpu and not e.cpu and not e.disk
                    and self.entries.get(e.program_id) is e):
                del self.entries[e.program_id]

    def take_for_request(self, e: KVEntry, total_pages: int) -> tuple[int, int]:
        """Bring all of ``e``'s CPU and disk pages onto the GPU and grow it to
        ``total_pages``.

        The caller has made room. The pages grown beyond those holding KV are reserved
        (``unmirrored``) until the caller reports them ``written``. Returns the pages that
        moved from the CPU and from the disk (reloaded).
        """
        reload, read = e.cpu, e.disk
        self.cpu_used -= e.cpu
        self.disk_used -= e.disk
        e.cpu = e.disk = 0
        grow = total_pages - e.gpu
        e.gpu = total_pages
        self.gpu_used += grow
        reserve = max(0, grow - reload - read)
        e.reserved += reserve
        self.unmirrored += reserve
        if not e._pinned:
            self._push(e)
        if read:  # the pages read from disk now hold KV on the GPU, copied in the host
            self._fit_cpu()
        return reload, read

    def remove(self, program_id: str) -> None:
        e = self.entries.pop(program_id, None)
        if e is not None:
            e._ver += 1  # its records are stale
            self.gpu_used -= e.gpu
            self.cpu_used -= e.cpu
            self.disk_used -= e.disk
            self.unmirrored -= e.reserved

    def check(self) -> None:
        swept = {pid for pid, e in self.entries.items()
                 if e.ended and not e.gpu and not e.cpu and not e.disk}
        tracked = {e.program_id for e in self._maybe_dead}
        assert swept <= tracked, f"ended, empty and not to be swept: {swept - tracked}"
        assert self.gpu_used == sum(e.gpu for e in self.entries.values())
        assert self.cpu_used == sum(e.cpu for e in self.entries.values())
        assert self.disk_used == sum(e.disk for e in self.entries.values())
        assert 0 <= self.gpu_used <= self.gpu_cap, (self.gpu_used, self.gpu_cap)
        assert self.unmirrored == sum(e.reserved for e in self.entries.values())
        assert all(0 <= e.reserved <= e.gpu for e in self.entries.values())
        assert 0 <= self.cpu_used <= self.cpu_room(), (self.cpu_used, self.cpu_room())
        assert 0 <= self.disk_used <= self.disk_cap, (self.disk_used, self.disk_cap)
        for tier, rank in (("gpu", self._gpu_rank), ("cpu", self._cpu_rank),
                           ("disk", self._disk_rank)):
            heap = self._heap(tier)
            current = {r[2] for r in heap if r[3] == r[4]._ver
                       and r[:2] == (rank[r[4]._label], r[4]._last_access)}
            evictable = {e.seq for e in self.entries.values()
                         if not e._pinned and self._pages(e, tier) > 0}
            assert evictable <= current, (
                f"{tier.upper()} eviction order misses {evictable - current}")
