"""``SizedOrder``: items kept in key order that can be walked skipping the too large.

The policy's candidate index (``mori.core.policies.mori_index``) needs, besides walking
its held programs in priority order, "the next one in that order whose KV fits in
``x`` bytes" while ``x`` shrinks as programs are placed. A sorted list cut into blocks,
each knowing the smallest size it holds, answers that by passing over whole blocks
whose smallest item is too large: a walk costs O(blocks + items looked at) instead of
O(items), and an insertion or removal O(log n + block size).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Key = tuple[Any, ...]

LOAD = 64
"""Items per block; a block is split at twice this."""


class SizedOrder(Generic[T]):
    """(key, size, item) triples in ascending key order; keys are unique tuples."""

    __slots__ = ("_keys", "_sizes", "_items", "_mins", "_tots", "_last", "_len", "_load")

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
            return
        self._tots[b] -= size
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

    def min_size(self) -> int | None:
        return min(self._mins) if self._mins else None

    def prefix(self, budget: float) -> tuple[Key | None, int]:
        """The longest prefix (in key order) whose sizes add up to at most ``budget``:
        its last key (None if empty) and its total. Whole blocks that fit are taken at
        once."""
        last: Key | None = None
        total = 0
        for b, tot in enumerate(self._tots):
            if total + tot <= budget:
                total += tot
                last = self._last[b]
                continue
            keys, sizes = self._keys[b], self._sizes[b]
            for j, size in enumerate(sizes):
                if total + size > budget:
                    return last, total
                total += size
                last = keys[j]
            return last, total  # pragma: no cover - the block would have fit whole
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
        order; ``limit`` is asked again before each block and each item, so it may
        shrink as the caller acts on what it is given. The order must not change while
        walking."""
        b, i = 0, 0
        if after is not None:
            b = bisect_left(self._last, after)
            if b < len(self._keys):
                keys = self._keys[b]
                i = bisect_left(keys, after)
                if i < len(keys) and keys[i] == after:
                    i += 1
        while b < len(self._keys):
            if self._mins[b] <= limit():
                keys, sizes, items = self._keys[b], self._sizes[b], self._items[b]
                for j in range(i, len(keys)):
                    if sizes[j] <= limit():
                        yield keys[j], sizes[j], items[j]
            b += 1
            i = 0
