"""The typed free queue inside a real vLLM ``BlockPool``: eviction by label, LRU within a
label, the shared-block rule, relabelling while queued, and ``drop``."""

from __future__ import annotations

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

from mori.vllm_plugin.typed_queue import TypedFreeBlockQueue

from .conftest import BS, make_pool, toks


def test_replacing_keeps_the_free_blocks_in_order() -> None:
    pool = BlockPool(10, True, BS)
    before = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    q = TypedFreeBlockQueue.replacing(pool.free_block_queue)
    assert [b.block_id for b in q.get_all_free_blocks()] == before == list(range(1, 10))
    assert q.num_free_blocks == 9
    pool.free_block_queue = q
    assert pool.get_num_free_blocks() == 9
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]


def test_without_labels_the_order_is_vllms() -> None:
    """Every hashed block busy (no label sent): the typed queue evicts as vLLM's does."""
    p = make_pool(16)
    plain = BlockPool(16, True, BS)
    from .conftest import HASHER, Request, SamplingParams  # the same requests on both
    for i, n in enumerate((2, 3, 1, 2)):
        p.serve(f"p{i}", toks(i, n))
        req = Request(f"plain{i}", toks(i, n), SamplingParams(max_tokens=1), None,
                      block_hasher=HASHER)
        blocks = plain.get_new_blocks(n)
        plain.cache_full_blocks(req, blocks, 0, n, BS, 0)
        plain.free_blocks(reversed(blocks))
    assert p.order() == [b.block_id for b in plain.free_block_queue.get_all_free_blocks()]


def test_eviction_order_unhashed_inactive_idle_busy() -> None:
    p = make_pool(16)
    busy = p.serve("busy", toks(0, 2))
    idle = p.serve("idle", toks(1, 2))
    inactive = p.serve("inactive", toks(2, 2))
    nolabel = p.serve("nolabel", toks(3, 2))
    anon = p.serve(None, toks(4, 2))  # a request without session_id
    p.set({"busy": "busy", "idle": "idle", "inactive": "inactive"})
    unhashed = [b for b in p.order() if p.pool.blocks[b].block_hash is None]
    assert len(unhashed) == 15 - 10
    # vLLM frees a request's blocks tail first: [second, first] per program
    rev = lambda ids: list(reversed(ids))  # noqa: E731
    assert p.order() == (unhashed + rev(inactive) + rev(idle)
                         + rev(busy) + rev(nolabel) + rev(anon))
    assert p.queue.sizes() == {"unhashed": 5, "inactive": 2, "cold": 0, "idle": 2, "busy": 6}
    # the pool evicts in that order: unhashed, then inactive, then idle
    got = [b.block_id for b in p.pool.get_new_blocks(8)]
    assert got == unhashed + rev(inactive) + [idle[1]]
    assert p.cached(toks(2, 2)) == 0 and p.cached(toks(1, 2)) == 1
    assert p.cached(toks(0, 2)) == p.cached(toks(3, 2)) == p.cached(toks(4, 2)) == 2


def test_a_cold_programs_blocks_go_after_the_inactive_before_the_idle() -> None:
    # cold: parked on the disk tier; its GPU blocks have their own list, between the
    # inactive and the idle ones (the GPU order of mori.core.eviction_order), although
    # they are the least recent
    p = make_pool(16)
    cold = p.serve("cold", toks(0, 2))
    idle = p.serve("idle", toks(1, 2))
    inactive = p.serve("inactive", toks(2, 2))
    p.set({"cold": "cold", "idle": "idle", "inactive": "inactive"})
    assert p.queue.sizes()["inactive"] == p.queue.sizes()["cold"] == 2
    assert p.hashed_order()[:6] == inactive[::-1] + cold[::-1] + idle[::-1]


def test_lru_within_a_label() -> None:
    p = make_pool(16)
    a = p.serve("a", toks(0, 2))
    b = p.serve("b", toks(1, 2))
    c = p.serve("c", toks(2, 2))
    p.set({"a": "idle", "b": "idle", "c": "idle"})
    # moved together: the relative (LRU) order is kept
    assert p.hashed_order() == a[::-1] + b[::-1] + c[::-1]
    # a runs again (prefix hit: touched, so out of the queue) and is freed: now newest
    p.serve("a", toks(0, 2))
    assert p.hashed_order() == b[::-1] + c[::-1] + a[::-1]


def test_a_shared_block_takes_the_most_protective_label() -> None:
    p = make_pool(16)
    shared = toks(9, 1)
    a = p.serve("a", shared + toks(0, 1, start=1))
    b = p.serve("b", shared + toks(1, 1, start=1))
    assert a[0] == b[0]  # the prefix block is shared (a cache hit for b)
    assert p.labels.programs_of(a[0]) == {"a", "b"}
    p.set({"a": "inactive", "b": "busy"})
    assert p.labels.label_of_block(a[0]) == "busy"
    assert p.hashed_order() == [a[1], b[1], a[0]]
    p.set({"b": "idle"})  # relabel while queued: the shared block follows b
    assert p.labels.label_of_block(a[0]) == "idle"
    assert p.hashed_order() == [a[1], b[1], a[0]]
    assert p.queue.queued_class(p.pool.blocks[b[1]]) == p.queue.queued_class(
        p.pool.blocks[a[0]])
    p.set({"b": "inactive"})
    assert p.queue.sizes()["inactive"] == 3


def test_relabel_while_queued_moves_to_the_tail_of_the_new_label() -> None:
    p = make_pool(16)
    a = p.serve("a", toks(0, 3))
    b = p.serve("b", toks(1, 2))
    p.set({"a": "inactive", "b": "inactive"})
    assert p.hashed_order() == a[::-1] + b[::-1]
    assert p.set({"a": "busy"}) == 3
    assert p.hashed_order() == b[::-1] + a[::-1]
    # back to inactive: a counts as used when it moved, after b; its own order is kept
    assert p.set({"a": "inactive"}) == 3
    assert p.hashed_order() == b[::-1] + a[::-1]
    assert p.set({"a": "inactive"}) == 0  # no change, no move
    # forgetting the labels (clear) puts both back to the default, busy
    affected = p.labels.clear()
    assert affected == set(a) | set(b)
    assert p.queue.reclassify(p.pool.blocks[x] for x in affected) == 5
    assert p.queue.sizes()["busy"] == 5


def test_drop_evicts_only_unheld_unshared_cached_blocks() -> None:
    p = make_pool(16)
    shared = toks(9, 1)
    a_done = p.serve("a", toks(0, 2))  # a's finished request: cached, free
    running = p.run("a", toks(5, 2))  # a's running request holds two blocks
    held = [b.block_id for b in p.held[running]]
    ab = p.serve("a", shared + toks(0, 1, start=1))
    bb = p.serve("b", shared + toks(1, 1, start=1))
    assert ab[0] == bb[0]
    p.set({"a": "idle", "b": "idle"})
    evicted = p.drop("a")
    assert evicted == set(a_done) | {ab[1]}
    for bid in evicted:
        blk = p.pool.blocks[bid]
        assert blk.block_hash is None and p.queue.queued_class(blk) == 0  # unhashed: first
    assert p.cached(toks(0, 2)) == 0
    assert p.cached(toks(5, 2)) == 2  # held by the running request: kept
    assert all(p.pool.blocks[b].ref_cnt == 1 for b in held)
    assert p.cached(shared) == 1 and p.labels.label_of_block(ab[0]) == "idle"  # b's
    assert "a" not in p.labels.labels()
    # the dropped blocks go with the never-cached ones, before any cached block
    n_unhashed = p.queue.sizes()["unhashed"]
    assert n_unhashed == 15 - 7 + 3
    first = {b.block_id for b in p.pool.get_new_blocks(n_unhashed)}
    assert set(evicted) <= first
    assert p.cached(shared + toks(1, 1, start=1)) == 2


def test_a_block_handed_out_again_forgets_its_programs() -> None:
    p = make_pool(6)  # 5 usable blocks
    a = p.serve("a", toks(0, 2))
    assert p.labels.blocks_of("a") == frozenset(a)
    p.serve("b", toks(1, 5))  # takes every block, a's included
    assert p.labels.blocks_of("a") == frozenset()
    assert all(p.labels.programs_of(x) == {"b"} for x in a)


def test_reset_prefix_cache_then_rebuild() -> None:
    p = make_pool(8)
    p.serve("a", toks(0, 2))
    p.set({"a": "inactive"})
    assert p.queue.sizes()["inactive"] == 2
    assert p.pool.reset_prefix_cache()
    assert p.queue.rebuild() == 2
    assert p.queue.sizes() == {"unhashed": 7, "inactive": 0, "cold": 0, "idle": 0, "busy": 0}


def test_queue_semantics_match_vllms() -> None:
    """Edge cases shared with FreeKVCacheBlockQueue: empty pops, removing a block that is
    not free, prepend order, iter_blocks_after across lists and from a stale cursor."""
    p = make_pool(10)
    q = p.queue
    a = p.serve("a", toks(0, 2))
    p.set({"a": "inactive"})
    blocks = p.pool.blocks
    with pytest.raises(RuntimeError):
        q.remove(p.pool.null_block)
    order = p.order()
    assert [b.block_id for b in q.iter_blocks_after(None)] == order
    cursor = blocks[order[2]]
    assert [b.block_id for b in q.iter_blocks_after(cursor)] == order[3:]
    last_unhashed = blocks[order[6]]  # the list boundary: unhashed -> inactive
    assert [b.block_id for b in q.iter_blocks_after(last_unhashed)] == a[::-1]
    assert list(q.iter_blocks_after(blocks[order[-1]])) == []
    q.remove(cursor)
    assert list(q.iter_blocks_after(cursor)) == []  # stale cursor
    q.prepend_n([cursor])
    assert p.order()[0] == cursor.block_id
    got = q.popleft_n(q.num_free_blocks)
    assert q.num_free_blocks == 0 and q.popleft_n(0) == []
    with pytest.raises(ValueError):
        q.popleft()
    q.append_n(got)
    assert q.num_free_blocks == len(got)
    ref = FreeKVCacheBlockQueue([])
    assert ref.num_free_blocks == 0 and TypedFreeBlockQueue([]).num_free_blocks == 0
