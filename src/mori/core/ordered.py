"""``SizedOrder``: items kept in key order that can be walked skipping the too large.

The policy's candidate index (``mori.core.policies.mori_index``) needs, besides walking
its held programs in priority order, "the next one in that order whose KV fits in
``x`` bytes" while ``x`` shrinks as programs are placed. A sorted list cut into blocks,
each knowing the smallest size it holds, answers that by passing over whole blocks
whose smallest item is too large: a walk costs O(blocks + items looked at) instead of
O(items), and an insertion or removal O(log n + block size). It also needs "the longest
prefix whose sizes fit ``x``" (the batch the total room admits): the blocks' totals are
kept in a Fenwick tree, so that costs O(log blocks + block size).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Key = tuple[Any, ...]

LOAD = 64
"""Items per block; a block is split at twice this."""


class SizedOrder(Generic[T]):
    """(key, size, item) triples in ascending key order; keys are unique tuples."""

    __slots__ = ("_keys", "_sizes", "_items", "_mins", "_tots", "_last", "_len", "_load",
                 "_fen", "_acc")

    def __init__(self, load: int | None = None) -> None:
        load = LOAD if load is None else load
        if load < 1:
            raise ValueError(f"load must be >= 1, got {load}")
        self._load = load
        self._keys: list[list[Key]] = []
        self._sizes: list[list[int]] = []
        self._items: list[list[T]] = []
        self._mins: list[int] = []  # the smallest size of each block
        self._tots: list[int] = []  # the total size of each block
        self._last: list[Key] = []  # the largest key of each block
        self._len = 0
        # the blocks' totals as a Fenwick tree (1-based) for prefix(); None: to rebuild
        # (after blocks were split or dropped, which is rare)
        self._fen: list[int] | None = None
        # each block's running totals for prefix(), made when first needed (None); kept
        # and reset with the tree
        self._acc: list[list[int] | None] | None = None

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def add(self, key: Key, size: int, item: T) -> None:
        if not self._keys:
            self._keys.append([key])
            self._sizes.append([size])
            self._items.append([item])
            self._mins.append(size)
            self._tots.append(size)
            self._last.append(key)
            self._len = 1
            self._fen = self._acc = None
            return
        b = min(bisect_left(self._last, key), len(self._last) - 1)
        keys = self._keys[b]
        i = bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            raise KeyError(f"key {key!r} is already present")
        keys.insert(i, key)
        self._sizes[b].insert(i, size)
        self._items[b].insert(i, item)
        if size < self._mins[b]:
            self._mins[b] = size
        self._tots[b] += size
        self._last[b] = keys[-1]
        self._len += 1
        if len(keys) > 2 * self._load:
            self._split(b)
        elif self._fen is not None:
            self._fen_add(b, size)
            assert self._acc is not None
            self._acc[b] = None

    def remove(self, key: Key) -> None:
        b = bisect_left(self._last, key)
        keys = self._keys[b] if b < len(self._keys) else []
        i = bisect_left(keys, key)
        if i >= len(keys) or keys[i] != key:
            raise KeyError(f"key {key!r} is not present")
        del keys[i]
        size = self._sizes[b].pop(i)
        del self._items[b][i]
        self._len -= 1
        if not keys:
            for arr in (self._keys, self._sizes, self._items, self._mins, self._tots,
                        self._last):
                del arr[b]
            self._fen = self._acc = None
            return
        self._tots[b] -= size
        if self._fen is not None:
            self._fen_add(b, -size)
            assert self._acc is not None
            self._acc[b] = None
        self._last[b] = keys[-1]
        if size == self._mins[b]:
            self._mins[b] = min(self._sizes[b])

    def _split(self, b: int) -> None:
        keys, sizes, items = self._keys[b], self._sizes[b], self._items[b]
        h = len(keys) // 2
        self._keys[b:b + 1] = [keys[:h], keys[h:]]
        self._sizes[b:b + 1] = [sizes[:h], sizes[h:]]
        self._items[b:b + 1] = [items[:h], items[h:]]
        self._mins[b:b + 1] = [min(sizes[:h]), min(sizes[h:])]
        self._tots[b:b + 1] = [sum(sizes[:h]), sum(sizes[h:])]
        self._last[b:b + 1] = [keys[h - 1], keys[-1]]
        self._fen = self._acc = None

    def _fen_add(self, b: int, delta: int) -> None:
        fen = self._fen
        assert fen is not None
        i, n = b + 1, len(fen) - 1
        while i <= n:
            fen[i] += delta
            i += i & -i

    def _fen_build(self) -> list[int]:
        fen = [0, *self._tots]
        n = len(fen) - 1
        for i in range(1, n + 1):
            j = i + (i & -i)
            if j <= n:
                fen[j] += fen[i]
        self._fen = fen
        self._acc = [None] * n
        return fen

    def min_size(self) -> int | None:
        return min(self._mins) if self._mins else None

    def prefix(self, budget: float) -> tuple[Key | None, int]:
        """The longest prefix (in key order) whose sizes add up to at most ``budget``:
        its last key (None if empty) and its total. The whole blocks that fit are found
        in O(log blocks) (a descent of the blocks' Fenwick tree), then the items of the
        next one."""
        fen = self._fen if self._fen is not None else self._fen_build()
        n = len(fen) - 1
        b, total = 0, 0  # blocks 0..b-1 fit whole
        step = 1 << (n.bit_length() - 1) if n else 0
        while step:
            nxt = b + step
            if nxt <= n and total + fen[nxt] <= budget:
                b, total = nxt, total + fen[nxt]
            step >>= 1
        last: Key | None = self._last[b - 1] if b else None
        if b < n and self._sizes[b][0] <= budget - total:  # part of block b fits
            accs = self._acc
            assert accs is not None
            inner = accs[b]
            if inner is None:
                inner = accs[b] = list(accumulate(self._sizes[b]))
            j = bisect_right(inner, budget - total)
            total += inner[j - 1]
            last = self._keys[b][j - 1]
        return last, total

    def first(self) -> tuple[Key, int, T] | None:
        if not self._keys:
            return None
        return self._keys[0][0], self._sizes[0][0], self._items[0][0]

    def __iter__(self) -> Iterator[tuple[Key, int, T]]:
        for keys, sizes, items in zip(self._keys, self._sizes, self._items, strict=True):
            yield from zip(keys, sizes, items, strict=True)

    def walk(self, limit: Callable[[], float], after: Key | None = None
             ) -> Iterator[tuple[Key, int, T]]:
        """The triples with key > ``after`` (all if None) and size <= ``limit()``, in
        order; ``limit`` is asked at the start and again after each triple given, so it
        may shrink as the caller acts on what it is given (it must not change
        otherwise). The order must not change while walking."""
        b, i = 0, 0
        if after is not None:
            b = bisect_left(self._last, after)
            if b < len(self._keys):
                keys = self._keys[b]
                i = bisect_left(keys, after)
                if i < len(keys) and keys[i] == after:
                    i += 1
        mins, nblocks = self._mins, len(self._keys)
        lim = limit()
        while b < nblocks:
            if mins[b] <= lim:
                keys, sizes, items = self._keys[b], self._sizes[b], self._items[b]
                for j in range(i, len(keys)):
                    if sizes[j] <= lim:
                        yield keys[j], sizes[j], items[j]
                        lim = limit()
            b += 1
            i = 0
