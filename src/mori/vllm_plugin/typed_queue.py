"""A free-block queue for vLLM's ``BlockPool`` that evicts by MORI's labels.

vLLM 0.32 keeps every free KV block (the cached ones that are eviction candidates
included) in one ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``): a doubly
linked list threaded through the blocks' own ``prev_free_block`` / ``next_free_block``
fields, whose head is evicted first. :class:`TypedFreeBlockQueue` has the same methods with
the same meaning, and keeps five such lists instead of one: first the blocks without a
hash (``block.block_hash is None``: never a prefix-cache hit), then one list per label,
in the GPU's order of ``mori.core.eviction_order`` (read from there).

Within a list the order is vLLM's: ``append`` / ``append_n`` put blocks at the tail (most
recently used, evicted last), ``prepend_n`` at the head (evicted first), so a list is LRU.
With every hashed block labelled ``busy`` (what happens when no label ever arrives) the
order is exactly vLLM's own: blocks without a hash first, then the cached blocks in LRU
order.

The label of a hashed block comes from ``label_of(block)`` (``mori.plugin_channel.labels``).
It is read when the block enters the queue; a block's label (or its hash) can change while
it sits in the queue, and :meth:`TypedFreeBlockQueue.reclassify` then moves it to the tail
of its new list: **a relabelled block counts as used at the moment of the move** (not at its
old age), and blocks moved together keep their relative order. So a program that turns
inactive has its blocks evicted after the programs that turned inactive before it, and a
program that turns busy again is protected as if it had just run. Keeping the old age
instead would need an ordered merge (not O(1)).

Every operation is O(1) per block (``get_all_free_blocks`` and ``iter_blocks_after`` walk
the lists, as vLLM's do; :meth:`reclassify` sorts the moved blocks). The block type is duck
typed (no vLLM import): anything with ``block_id``, ``block_hash``, ``prev_free_block`` and
``next_free_block``.

Known differences from vLLM's queue: a block released by ``BlockPool.unpin_blocks`` (the
HiSparse path, meant as a last-resort candidate) has no hash, so it lands in the first
list; and a block whose hash the pool drops while it is queued (``reset_prefix_cache``,
``evict_blocks``) stays in its labelled list until :meth:`reclassify` (the scheduler calls it
after both) — harmless either way: the block is still free and still evicted eventually.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from mori.core.eviction_order import eviction_order, ranks
from mori.core.types import Tier

# the lists, evicted first .. last: blocks without a hash, then one list per label in the
# GPU's order of mori.core.eviction_order (read from there)
UNHASHED = 0
LABEL_CLASS = {label.value: 1 + rank for label, rank in ranks(Tier.GPU).items()}
INACTIVE, COLD, IDLE, BUSY = (LABEL_CLASS[n] for n in ("inactive", "cold", "idle", "busy"))
CLASS_NAMES = ("unhashed", *(label.value for label in eviction_order(Tier.GPU)))

# The methods of vLLM 0.32's FreeKVCacheBlockQueue that code outside it calls (BlockPool:
# popleft, popleft_n, remove, append, append_n, prepend_n, num_free_blocks; the simple
# offload connector: iter_blocks_after; tests: get_all_free_blocks). The contract test
# (tests/vllm_inside) pins this list against the installed vLLM.
QUEUE_METHODS = ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n",
                 "get_all_free_blocks", "iter_blocks_after")
QUEUE_ATTRIBUTES = ("num_free_blocks",)


class Block(Protocol):
    """What the queue needs of vLLM's ``KVCacheBlock``."""

    block_id: int
    prev_free_block: Any
    next_free_block: Any

    @property
    def block_hash(self) -> object | None: ...


class _End:
    """A list's fake head or tail (never handed out; ``block_id`` -1 like vLLM's)."""

    __slots__ = ("block_id", "prev_free_block", "next_free_block")

    def __init__(self) -> None:
        self.block_id = -1
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


def _busy(_block: Any) -> str:
    return "busy"


class TypedFreeBlockQueue:
    """Drop-in for ``FreeKVCacheBlockQueue`` with one LRU list per eviction class.

    ``blocks``: the free blocks, in eviction order (as vLLM's constructor takes them);
    ``label_of(block)``: the label (``busy``/``idle``/``cold``/``inactive``) of a hashed
    block (any other counts as ``busy``);
    ``on_pop(block)``: called for each block ``popleft``/``popleft_n`` hand out (the pool
    reuses it for new content, so what was known about the old content is stale).
    """

    def __init__(self, blocks: Iterable[Any],
                 label_of: Callable[[Any], str] | None = None,
                 on_pop: Callable[[Any], None] | None = None) -> None:
        self.num_free_blocks = 0
        self._label_of = label_of or _busy
        self._on_pop = on_pop
        self._heads = [_End() for _ in CLASS_NAMES]
        self._tails = [_End() for _ in CLASS_NAMES]
        for head, tail in zip(self._heads, self._tails, strict=True):
            head.next_free_block = tail
            tail.prev_free_block = head
        self._sizes = [0] * len(CLASS_NAMES)
        self._cls: dict[int, int] = {}  # block_id -> the list it is in (only while queued)
        self._stamp: dict[int, int] = {}  # block_id -> position stamp (order within a list)
        self._clock = 0  # next tail stamp
        self._low = 0  # last head stamp
        self.append_n(list(blocks))

    # -- classification -----------------------------------------------------------------
    def class_of(self, block: Any) -> int:
        """The list ``block`` belongs in now (``UNHASHED`` .. ``BUSY``)."""
        if block.block_hash is None:
            return UNHASHED
        return LABEL_CLASS.get(self._label_of(block), BUSY)

    def queued_class(self, block: Any) -> int | None:
        """The list ``block`` is in, or None when it is not free."""
        return self._cls.get(block.block_id)

    def sizes(self) -> dict[str, int]:
        """How many free blocks each list holds."""
        return dict(zip(CLASS_NAMES, self._sizes, strict=True))

    # -- linking ------------------------------------------------------------------------
    def _link_tail(self, block: Any, c: int) -> None:
        tail = self._tails[c]
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self._sizes[c] += 1
        self._cls[block.block_id] = c
        self._stamp[block.block_id] = self._clock
        self._clock += 1

    def _link_head(self, block: Any, c: int) -> None:
        head = self._heads[c]
        first = head.next_free_block
        head.next_free_block = block
        block.prev_free_block = head
        block.next_free_block = first
        first.prev_free_block = block
        self._sizes[c] += 1
        self._cls[block.block_id] = c
        self._low -= 1
        self._stamp[block.block_id] = self._low

    def _unlink(self, block: Any) -> None:
        prev_block = block.prev_free_block
        next_block = block.next_free_block
        c = self._cls.get(block.block_id)
        if prev_block is None or next_block is None or c is None:
            # As vLLM's queue: the caller's logic is wrong (the block is not free).
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self._sizes[c] -= 1
        del self._cls[block.block_id]
        del self._stamp[block.block_id]

    # -- FreeKVCacheBlockQueue's methods --------------------------------------------------
    def popleft(self) -> Any:
        """Pop the block to evict first; ``ValueError`` when none is free."""
        for c in range(len(CLASS_NAMES)):
            if self._sizes[c]:
                block = self._heads[c].next_free_block
                self._unlink(block)
                self.num_free_blocks -= 1
                if self._on_pop is not None:
                    self._on_pop(block)
                return block
        assert self.num_free_blocks == 0, (
            f"num_free_blocks ({self.num_free_blocks}) is out of sync with the free lists.")
        raise ValueError("No free blocks available")

    def popleft_n(self, n: int) -> list[Any]:
        """Pop the ``n`` blocks to evict first."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        return [self.popleft() for _ in range(n)]

    def remove(self, block: Any) -> None:
        """Take a free block out of the queue (a prefix-cache hit reuses it)."""
        self._unlink(block)
        self.num_free_blocks -= 1

    def append(self, block: Any) -> None:
        """Put a block at the tail of its list (evicted last within its label)."""
        self._link_tail(block, self.class_of(block))
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[Any]) -> None:
        """``append`` each block, in order."""
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: list[Any]) -> None:
        """Put blocks at the head of their lists, ``blocks[0]`` evicted first."""
        for block in reversed(blocks):
            self._link_head(block, self.class_of(block))
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[Any]:
        """Every free block, in eviction order."""
        return list(self.iter_blocks_after(None))

    def iter_blocks_after(self, cursor: Any | None) -> Iterator[Any]:
        """Free blocks in eviction order after ``cursor`` (from the first when None).

        A cursor that is no longer free yields nothing (as in vLLM's queue, where a
        removed block has no successor).
        """
        if cursor is None:
            c = 0
            cur = self._heads[0].next_free_block
        else:
            found = self._cls.get(cursor.block_id)
            if found is None or cursor.next_free_block is None:
                return
            c = found
            cur = cursor.next_free_block
        last = len(CLASS_NAMES) - 1
        while True:
            while cur is self._tails[c]:
                if c == last:
                    return
                c += 1
                cur = self._heads[c].next_free_block
            yield cur
            cur = cur.next_free_block

    # -- MORI's additions ---------------------------------------------------------------
    def reclassify(self, blocks: Iterable[Any]) -> int:
        """Move each queued block whose list changed (label or hash) to its new list's
        tail, keeping the moved blocks' relative order; blocks not free are skipped.
        Returns how many moved."""
        moving: list[tuple[int, int, Any]] = []
        seen: set[int] = set()
        for block in blocks:
            bid = block.block_id
            old = self._cls.get(bid)
            if old is None or bid in seen:
                continue
            seen.add(bid)
            new = self.class_of(block)
            if new != old:
                moving.append((self._stamp[bid], new, block))
        moving.sort(key=lambda t: t[0])
        for _, new, block in moving:
            self._unlink(block)
            self._link_tail(block, new)
        return len(moving)

    def rebuild(self) -> int:
        """:meth:`reclassify` every free block (after the pool reset many hashes)."""
        return self.reclassify(self.get_all_free_blocks())

    @classmethod
    def replacing(cls, old: Any, label_of: Callable[[Any], str] | None = None,
                  on_pop: Callable[[Any], None] | None = None) -> TypedFreeBlockQueue:
        """A typed queue holding ``old``'s free blocks (a ``FreeKVCacheBlockQueue``), in
        its order within each list."""
        blocks = old.get_all_free_blocks()
        assert len(blocks) == old.num_free_blocks, (
            f"the free queue holds {len(blocks)} blocks but counts {old.num_free_blocks}")
        return cls(blocks, label_of=label_of, on_pop=on_pop)
