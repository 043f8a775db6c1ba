"""KV residency of one engine replica: a GPU pool and a CPU pool of pages.

A program's cached KV is a prefix of its context (block hashes are chained, and a
radix-tree or paged cache evicts from the leaves, i.e. the tail). So per program we keep
``gpu`` pages (the prefix on the GPU) and ``cpu`` pages (the pages right after it, held
only on the CPU). All pages of a program are touched together by each request, so LRU at
program granularity equals page-level LRU here.

The CPU pool is *exclusive*: it counts only pages not on the GPU. With write-through the
engine's host pool also mirrors what is on the GPU, so ``cpu_pages`` here is the host
pool minus the mirror; evicting a page from the GPU moves it to the CPU at no transfer
cost (its copy was written while it was computed).

Eviction order: with ``typed`` (MORI), by type label first, reversed per tier
(GPU: inactive, idle, busy; CPU: inactive, busy, idle), then least recently used;
otherwise plain LRU. Pinned programs (a request running) are never evicted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from heapq import heapify, heappop, heappush

from mori.core.types import KVLabel

_GPU_RANK = {KVLabel.INACTIVE: 0, KVLabel.IDLE: 1, KVLabel.BUSY: 2}
_CPU_RANK = {KVLabel.INACTIVE: 0, KVLabel.BUSY: 1, KVLabel.IDLE: 2}
_NO_RANK = {KVLabel.INACTIVE: 0, KVLabel.IDLE: 0, KVLabel.BUSY: 0}  # plain LRU

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

    def __init__(self, gpu_pages: int, cpu_pages: int, typed: bool) -> None:
        if gpu_pages <= 0:
            raise ValueError(f"GPU pool must hold at least one page, got {gpu_pages}")
        self.gpu_cap = gpu_pages
        self.cpu_cap = max(0, cpu_pages)
        self.typed = typed
        self.gpu_used = 0
        self.cpu_used = 0
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
        self._gpu_heap: list[_Record] = []
        self._cpu_heap: list[_Record] = []
        self._created = 0
        self.evicted_gpu_pages = 0
        self.dropped_pages = 0

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
        """The request is over (used at ``now``, if given)."""
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
                self._gpu_heap = self._compact(heap, True)
        if e.cpu > 0:
            heap = self._cpu_heap
            heappush(heap, (self._cpu_rank[e._label], e._last_access, e.seq, e._ver, e))
            if len(heap) > 2 * len(self.entries) + 64:
                self._cpu_heap = self._compact(heap, False)

    @staticmethod
    def _compact(heap: list[_Record], gpu: bool) -> list[_Record]:
        live = [r for r in heap if r[3] == r[4]._ver and not r[4]._pinned
                and (r[4].gpu if gpu else r[4].cpu) > 0]
        heapify(live)
        return live

    def gpu_free(self) -> int:
        return self.gpu_cap - self.gpu_used

    # -- changes ---------------------------------------------------------------------
    def truncate(self, e: KVEntry, valid_pages: int) -> None:
        """Forget pages past ``valid_pages`` (a context that changed: stale branch)."""
        keep_gpu = min(e.gpu, valid_pages)
        keep_cpu = min(e.cpu, max(0, valid_pages - keep_gpu))
        self.gpu_used -= e.gpu - keep_gpu
        self.cpu_used -= e.cpu - keep_cpu
        if (keep_gpu, keep_cpu) != (e.gpu, e.cpu):
            self._track(e)
        e.gpu, e.cpu = keep_gpu, keep_cpu

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
        for e in self._victims(gpu=True):
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
        self._track(e)
        if self.cpu_cap == 0:
            self.dropped_pages += n + e.cpu
            self.cpu_used -= e.cpu
            e.cpu = 0
            return
        # the moved pages sit right before e's CPU-only pages
        e.cpu += n
        self.cpu_used += n
        self._push(e)  # now evictable from the CPU
        if self.cpu_used > self.cpu_cap:
            self._shrink_cpu(self.cpu_used - self.cpu_cap)
        if self.cpu_used > self.cpu_cap:  # only pinned pages left to drop: lose these
            lose = min(e.cpu, self.cpu_used - self.cpu_cap)
            e.cpu -= lose
            self.cpu_used -= lose
            self.dropped_pages += lose

    def _shrink_cpu(self, pages: int) -> None:
        for e in self._victims(gpu=False):
            if pages <= 0:
                break
            n = min(pages, e.cpu)
            e.cpu -= n
            self._track(e)
            self.cpu_used -= n
            self.dropped_pages += n
            pages -= n
        self._sweep()

    def _victims(self, gpu: bool) -> Iterator[KVEntry]:
        """The entries holding pages in a tier, first to evict first, as the caller
        evicts: each is given while it heads the order, so the caller must take all its
        pages in the tier or stop (a partly evicted entry would be given again)."""
        while True:
            heap = self._gpu_heap if gpu else self._cpu_heap  # (a push may compact it)
            if not heap:
                return
            _, _, _, ver, e = heap[0]
            if ver != e._ver or e._pinned or (e.gpu if gpu else e.cpu) <= 0:
                heappop(heap)  # stale
                continue
            yield e

    def eviction_order(self, gpu: bool) -> list[KVEntry]:
        """The entries holding pages in a tier, first to evict first (read only)."""
        heap = self._gpu_heap if gpu else self._cpu_heap
        return [r[4] for r in sorted(self._compact(heap, gpu))]

    def _sweep(self) -> None:
        """Drop the entries of ended programs that hold no page."""
        maybe, self._maybe_dead = self._maybe_dead, []
        for e in maybe:
            if (e.ended and not e.gpu and not e.cpu
                    and self.entries.get(e.program_id) is e):
                del self.entries[e.program_id]

    def take_for_request(self, e: KVEntry, total_pages: int) -> int:
        """Bring all of ``e``'s CPU pages onto the GPU and grow it to ``total_pages``.

        The caller has made room. Returns the pages that moved from the CPU (reloaded).
        """
        reload = e.cpu
        self.cpu_used -= e.cpu
        e.cpu = 0
        grow = total_pages - e.gpu
        e.gpu = total_pages
        self.gpu_used += grow
        if not e._pinned:
            self._push(e)
        return reload

    def remove(self, program_id: str) -> None:
        e = self.entries.pop(program_id, None)
        if e is not None:
            e._ver += 1  # its records are stale
            self.gpu_used -= e.gpu
            self.cpu_used -= e.cpu

    def check(self) -> None:
        swept = {pid for pid, e in self.entries.items() if e.ended and not e.gpu and not e.cpu}
        tracked = {e.program_id for e in self._maybe_dead}
        assert swept <= tracked, f"ended, empty and not to be swept: {swept - tracked}"
        assert self.gpu_used == sum(e.gpu for e in self.entries.values())
        assert self.cpu_used == sum(e.cpu for e in self.entries.values())
        assert 0 <= self.gpu_used <= self.gpu_cap, (self.gpu_used, self.gpu_cap)
        assert 0 <= self.cpu_used <= self.cpu_cap, (self.cpu_used, self.cpu_cap)
        for gpu, rank in ((True, self._gpu_rank), (False, self._cpu_rank)):
            heap = self._gpu_heap if gpu else self._cpu_heap
            current = {r[2] for r in heap if r[3] == r[4]._ver
                       and r[:2] == (rank[r[4]._label], r[4]._last_access)}
            evictable = {e.seq for e in self.entries.values()
                         if not e._pinned and (e.gpu if gpu else e.cpu) > 0}
            assert evictable <= current, (
                f"{'GPU' if gpu else 'CPU'} eviction order misses {evictable - current}")
