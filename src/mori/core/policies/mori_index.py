"""What MORI keeps up to date between decision rounds, so a round touches only what
changed and what must move (``MoriPolicy``; the straightforward round that recomputes
all of it is the differential test's reference).

- ``CandidateIndex``: the held programs not on a GPU, in promotion order, per replica
  for those in a CPU queue and one order for those in Uncached. A held program's
  priority (its level, its context for a new one, its idleness, its arrival) does not
  change while it is held: idleness excludes held time, so idleness is frozen from the
  arrival to the forward. ``mori-no-exclusion`` counts held time, so it cannot use the
  index and scans instead.
- ``ReplicaSums``: per replica, the KV bytes of its Acting and of its Reasoning GPU
  programs, and the GPU bytes in use over all replicas.
- ``ReplicaOrder``: the replicas sorted by a value (the GPU room they have), so the one
  with the most room, or the tightest that holds a given size, is found in O(log R).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable, Iterator

from mori.core.ordered import LOAD, Key, SizedOrder
from mori.core.program import Program
from mori.core.types import Status, Tier

_TOP = (3,)  # sorts after every priority key (levels are 0, 1, 2)


AFFINE = (Tier.CPU, Tier.DISK)
"""The tiers whose programs go back to their own replica (affinity): the KV they return
to is there, in its CPU or its disk queue."""


Priority = Callable[[Program, float], Key]
"""A promotion order: a held program and its idleness -> its key, the first promoted
first. A key is (level, context, idleness, arrival); its third item is the idleness."""


def priority(p: Program, idleness: float) -> Key:
    """The paper's promotion order (``mori`` module docstring): (0) CPU queue, (1)
    returning (a program on disk is one, and goes before those in Uncached: it is
    promoted with the CPU-queue programs, onto its own replica), (2) new programs
    smallest context first; lowest idleness first; then arrival."""
    level = 0 if p.tier is Tier.CPU else 1 if p.returning else 2
    return (level, p.tokens if level == 2 else 0, idleness, p.ready_seq)


def priority_smallest_first(p: Program, idleness: float) -> Key:
    """MORI's own promotion order (ours, not the paper's): (0) CPU queue and (1) disk
    queue by idleness, as the paper's; (2) every program with nothing cached, returning
    or new, smallest context first, then lowest idleness, then arrival.

    A program with nothing cached costs a recompute of its whole context to admit and
    takes that much GPU room however busy it has been, and on an engine whose GPU
    memory is full the number of requests it runs at once sets its throughput. The
    paper's order admits returning programs by idleness whatever their size, which
    filled the GPU with the longest contexts and ran fewer requests at once than
    ThunderAgent (measured: docs/results.md, "The smallest first")."""
    if p.tier is Tier.CPU:
        return (0, 0, idleness, p.ready_seq)
    if p.tier is Tier.DISK:
        return (1, 0, idleness, p.ready_seq)
    return (2, p.tokens, idleness, p.ready_seq)


class CandidateIndex:
    """Held programs in a CPU or disk queue (per replica: ``cpu``, ``cpu_all``, named for
    the CPU queue that came first) or in Uncached, by priority."""

    __slots__ = ("cpu", "cpu_all", "uncached", "uncached_by_size", "_entry", "_cpu_nonempty")

    def __init__(self, replicas: int) -> None:
        self.cpu: list[SizedOrder[Program]] = [SizedOrder() for _ in range(replicas)]
        self.cpu_all: SizedOrder[Program] = SizedOrder()  # every replica's, one order
        self.uncached: SizedOrder[Program] = SizedOrder()
        # the same candidates by (size, key): the few small enough to fit, at once
        self.uncached_by_size: list[tuple[int, Key, Program]] = []
        # id -> key, CPU replica (None: Uncached), size
        self._entry: dict[str, tuple[Key, int | None, int]] = {}
        self._cpu_nonempty: set[int] = set()

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, program_id: object) -> bool:
        return program_id in self._entry

    def key_of(self, program_id: str) -> Key | None:
        e = self._entry.get(program_id)
        return None if e is None else e[0]

    def cpu_nonempty(self) -> set[int]:
        """The replicas whose CPU queue holds a candidate (not to be changed)."""
        return self._cpu_nonempty

    def cpu_replicas(self) -> list[int]:
        """The replicas whose CPU queue holds a candidate, ascending."""
        return sorted(self._cpu_nonempty)

    def put(self, p: Program, key: Key) -> None:
        assert p.program_id not in self._entry, f"{p.program_id} indexed twice"
        if p.tier in AFFINE:
            assert p.replica is not None
            self.cpu[p.replica].add(key, p.kv_bytes, p)
            self.cpu_all.add(key, p.kv_bytes, p)
            self._cpu_nonempty.add(p.replica)
            self._entry[p.program_id] = (key, p.replica, p.kv_bytes)
        else:
            assert p.tier is Tier.NONE, f"{p.program_id} on a GPU is not a candidate"
            self.uncached.add(key, p.kv_bytes, p)
            insort(self.uncached_by_size, (p.kv_bytes, key, p))
            self._entry[p.program_id] = (key, None, p.kv_bytes)

    def discard(self, program_id: str) -> int | None:
        """Forget ``program_id``; the CPU replica it was indexed under, if any."""
        e = self._entry.pop(program_id, None)
        if e is None:
            return None
        key, replica, kv = e
        if replica is None:
            self.uncached.remove(key)
            by_size = self.uncached_by_size
            del by_size[bisect_left(by_size, (kv, key))]
        else:
            order = self.cpu[replica]
            order.remove(key)
            self.cpu_all.remove(key)
            if not order:
                self._cpu_nonempty.discard(replica)
        return replica

    def uncached_up_to(self, size: float, after: Key | None = None,
                      upto: Key | None = None) -> list[tuple[Key, int, Program]]:
        """The Uncached candidates of at most ``size`` bytes with ``after`` < key <=
        ``upto`` (None: no bound), in key order: from the size order when few are that
        small, else by a walk of the key order passing over blocks too large."""
        by_size = self.uncached_by_size
        n = bisect_right(by_size, (size, _TOP))
        if n == 0:
            return []
        if n <= 2 * LOAD:
            return sorted((k, kv, c) for kv, k, c in by_size[:n]
                          if (after is None or k > after) and (upto is None or k <= upto))
        out = []
        for k, kv, c in self.uncached.walk(lambda: size, after):
            if upto is not None and k > upto:
                break
            out.append((k, kv, c))
        return out

    def uncached_fits(self, size: float) -> bool:
        """Whether some Uncached candidate is no larger than ``size``."""
        by_size = self.uncached_by_size
        return bool(by_size) and by_size[0][0] <= size

    def uncached_fitting(self, limit: Callable[[], float], after: Key | None = None
                        ) -> Iterator[Program]:
        """The Uncached candidates with key > ``after`` and size <= ``limit()``, in key
        order, as ``uncached_up_to(limit())`` would list them, but lazily: ``limit`` may
        shrink while walking, and whole blocks then too large are passed over."""
        size = limit()
        if not self.uncached_fits(size):
            return
        if bisect_right(self.uncached_by_size, (size, _TOP)) <= 2 * LOAD:
            yield from (c for _, _, c in self.uncached_up_to(size, after))
            return
        yield from (c for _, _, c in self.uncached.walk(limit, after))

    def entries(self) -> dict[str, tuple[Key, int | None]]:
        """A copy of id -> (key, CPU replica or None) (integrity checks)."""
        return {pid: (k, r) for pid, (k, r, _) in self._entry.items()}


class ReplicaSums:
    """Per replica the KV bytes of its Acting and its Reasoning GPU programs; the GPU
    bytes in use over all replicas. ``account(p, +1)`` after a change, ``-1`` before."""

    __slots__ = ("acting", "reasoning", "gpu_used")

    def __init__(self, replicas: int) -> None:
        self.acting = [0] * replicas
        self.reasoning = [0] * replicas
        self.gpu_used = 0

    def account(self, p: Program, sign: int) -> None:
        if p.tier is not Tier.GPU:
            return
        r = p.replica
        assert r is not None
        nbytes = sign * p.kv_bytes
        self.gpu_used += nbytes
        status = p.status
        if status is Status.ACTING:
            self.acting[r] += nbytes
        elif status is Status.REASONING:
            self.reasoning[r] += nbytes


class ReplicaOrder:
    """Replicas sorted by an integer value each (most first, then lowest index)."""

    __slots__ = ("_order", "_of")

    def __init__(self, replicas: int, value: int) -> None:
        self._order = [(-value, r) for r in range(replicas)]  # ascending
        self._of = [value] * replicas

    def __getitem__(self, replica: int) -> int:
        return self._of[replica]

    def set(self, replica: int, value: int) -> None:
        old = self._of[replica]
        if old == value:
            return
        order = self._order
        i = bisect_left(order, (-old, replica))
        new = (-value, replica)
        if (i == 0 or order[i - 1] < new) and (i + 1 == len(order) or new < order[i + 1]):
            order[i] = new  # its place does not change
        else:
            del order[i]
            insort(order, new)
        self._of[replica] = value

    def most(self) -> int:
        return -self._order[0][0]

    def most_but(self, replica: int, value: int) -> int:
        """``most()`` were ``replica``'s value ``value`` instead."""
        order = self._order
        top = order[0] if order[0][1] != replica else order[1] if len(order) > 1 else None
        return value if top is None else max(value, -top[0])

    def tightest(self, need: int) -> int | None:
        """The replica with the least value >= ``need`` (lowest index among equals)."""
        order = self._order
        i = bisect_right(order, (-need, len(self._of))) - 1
        if i < 0:
            return None
        return order[bisect_left(order, (order[i][0], -1))][1]

    def roomiest(self, need: int) -> int | None:
        """The replica with the most value if that is >= ``need`` (lowest index among
        equals)."""
        neg, r = self._order[0]
        return r if -neg >= need else None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(value, replica), the most first, lowest index among equals."""
        for neg, r in self._order:
            yield -neg, r

    def check(self) -> None:
        assert self._order == sorted((-v, r) for r, v in enumerate(self._of))


_MARGIN = 1e-9  # slack on the bounds: rounding never reorders what they rule out
_W0 = 1e-3  # the reasoning time (s) where the first geometric bucket starts
_PER_OCTAVE = 4  # buckets per doubling of w


class IdlenessOrder:
    """Programs of one queue, walked most idle first at any ``now`` without computing
    every program's idleness (``descending``): the exact order ``sorted(key=IdlenessAt.desc)``
    gives, i.e. idleness descending, then the later request first.

    An Acting program's idleness is ``1 - w / (now - b)`` for its fixed ``(w, b)``
    (``IdlenessTracker.acting_line``): it grows with ``now``, and two programs can swap
    places over time. Acting programs are kept in buckets of ``w`` (four per doubling;
    a bucket's bound is exact whatever its span, the span only sets how tight it is)
    ordered by ``b``; within a bucket, ``1 - w_min / (now - b)`` (``w_min`` the
    bucket's least ``w``) bounds every later program from above. A held program's idleness does not change while it is held:
    those are kept in one list, most idle first. ``descending`` expands the bucket
    whose bound is highest until the best exact value found beats every bound left,
    so it computes the idleness of the programs it yields and of a few per bucket beside.
    """

    __slots__ = ("_acting", "_ws", "_held", "_entry")

    def __init__(self) -> None:
        self._acting: dict[int, list[tuple[float, int, Program]]] = {}  # bucket -> (b, -seq, p)
        self._ws: dict[int, list[float]] = {}  # bucket -> its programs' w, ascending
        self._held: list[tuple[float, int, Program]] = []  # (-idleness, -seq, p)
        self._entry: dict[str, tuple[int | None, tuple[float, int, Program]]] = {}

    def __len__(self) -> int:
        return len(self._entry)

    def ids(self) -> set[str]:
        return set(self._entry)

    def programs(self) -> Iterator[Program]:
        """The programs, in no particular order."""
        for _, item in self._entry.values():
            yield item[2]

    def add(self, p: Program, held_idleness: float | None) -> None:
        """Index ``p``: Acting (its line), or held with idleness ``held_idleness``."""
        line = p.tracker.acting_line()
        if line is None:
            assert held_idleness is not None, f"{p.program_id}: neither acting nor held"
            item = (-held_idleness, -p.ready_seq, p)
            insort(self._held, item)
            self._entry[p.program_id] = (None, item)
            return
        w, b = line
        bucket = -1 if w <= 0.0 else max(0, int(_PER_OCTAVE * math.log2(w / _W0)))
        item = (b, -p.ready_seq, p)
        insort(self._acting.setdefault(bucket, []), item)
        insort(self._ws.setdefault(bucket, []), w)
        self._entry[p.program_id] = (bucket, item)

    def discard(self, program_id: str) -> None:
        e = self._entry.pop(program_id, None)
        if e is None:
            return
        bucket, item = e
        lst = self._held if bucket is None else self._acting[bucket]
        del lst[bisect_left(lst, item[:2])]
        if bucket is not None:
            line = item[2].tracker.acting_line()
            assert line is not None, "an Acting program changed phase before leaving"
            ws = self._ws[bucket]
            del ws[bisect_left(ws, line[0])]
            if not lst:
                del self._acting[bucket], self._ws[bucket]

    def descending(self, idleness: Callable[[Program], float], now: float) -> Iterator[Program]:
        """The programs, most idle first (ties: the later request first), with their
        exact idleness from ``idleness`` (the round's values). The set must not change while
        walking."""
        frontier: list[tuple[float, int, int]] = []  # (-bound, bucket, position)
        for bucket, lst in self._acting.items():
            heapq.heappush(frontier, (-self._bound(self._ws[bucket][0], lst[0][0], now),
                                      bucket, 0))
        held, hp = self._held, 0
        found: list[tuple[float, int, int, Program]] = []  # (-idleness, -seq, n, p)
        n = 0
        while True:
            best = -found[0][0] if found else -math.inf
            while True:
                top = -frontier[0][0] if frontier else -math.inf
                hv = -held[hp][0] if hp < len(held) else -math.inf
                if max(top, hv) < best - _MARGIN or (top == hv == -math.inf):
                    break
                n += 1
                if hv >= top:
                    _, negseq, p = held[hp]
                    hp += 1
                else:
                    _, bucket, pos = heapq.heappop(frontier)
                    lst = self._acting[bucket]
                    _, negseq, p = lst[pos]
                    if pos + 1 < len(lst):
                        heapq.heappush(frontier, (-self._bound(
                            self._ws[bucket][0], lst[pos + 1][0], now), bucket, pos + 1))
                heapq.heappush(found, (-idleness(p), negseq, n, p))
                best = -found[0][0]
            if not found:
                return
            yield heapq.heappop(found)[3]

    @staticmethod
    def _bound(w_low: float, b: float, now: float) -> float:
        """An upper bound of idleness at ``now`` for programs with ``w >= w_low`` and a
        ``b`` no earlier than this one (a bucket's from this position on)."""
        span = now - b
        if w_low <= 0.0 or span <= 0.0:
            return 1.0 + _MARGIN
        return 1.0 - w_low / span + _MARGIN
