"""The radix-cache backend ``mori`` on SGLang's own cache classes: owners, MORI's order
against SGLang's LRU on the GPU and on HiCache's host tier, the label channel."""

from __future__ import annotations

import json

import pytest
import zmq
from sglang.srt.mem_cache.registry import registered_radix_cache_backends
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.server_args import ServerArgs

from mori.plugin_channel.protocol import Message
from mori.sglang_plugin import backend

from .conftest import Tree, build_tree, seq


@pytest.fixture
def mori() -> Tree:
    tree = build_tree("mori")
    yield tree
    tree.cache.mori_close()


def test_registered_and_accepted_by_sglangs_flags() -> None:
    backend.register()
    backend.register()  # idempotent: SGLang may load plug-ins more than once
    assert "mori" in registered_radix_cache_backends()
    assert ServerArgs(model_path="dummy", device="cpu",
                      radix_cache_backend="mori").radix_cache_backend == "mori"
    tree = build_tree("mori")
    try:
        cache = tree.cache
        assert isinstance(cache, backend.MoriRadixCache)
        assert isinstance(cache, UnifiedRadixCache)
        assert type(cache.tree_core) is backend.MoriTreeCore
        assert cache.tree_core.eviction_strategy is cache.mori_eviction
    finally:
        tree.cache.mori_close()


def test_nodes_learn_their_programs_and_a_split_keeps_them(mori: Tree) -> None:
    mori.run("a", seq(0, 12))
    mori.run("b", seq(0, 8) + seq(500, 4))  # shares the first two pages with a: a split
    core = mori.cache.tree_core
    owners = {}
    stack = list(core.root_node.children.values())
    while stack:
        node = stack.pop()
        owners[tuple(node.key.token_ids)] = sorted(getattr(node, "mori_owners", ()))
        stack.extend(node.children.values())
    assert owners == {tuple(seq(0, 8)): ["a", "b"], tuple(seq(8, 4)): ["a"],
                      tuple(seq(500, 4)): ["b"]}


def _three_programs(tree: Tree) -> None:
    """busy's prefix is the oldest, idle's next, inactive's the newest (LRU would evict
    busy first); each is two pages of the 16-page pool."""
    tree.run("busy", seq(0))
    tree.run("idle", seq(100))
    tree.run("inactive", seq(200))


def test_typed_eviction_keeps_the_busy_program_where_lru_loses_it(mori: Tree) -> None:
    stock = build_tree(None)
    for tree in (mori, stock):
        _three_programs(tree)
    mori.label(busy="busy", idle="idle", inactive="inactive")
    for tree in (mori, stock):
        assert tree.evict(8) == 8  # room for one program
    # SGLang's LRU drops the busy program's prefix, the oldest
    assert (stock.cached(seq(0)), stock.cached(seq(100)), stock.cached(seq(200))) == (0, 8, 8)
    # MORI's order drops the inactive one's, the newest, and keeps busy and idle
    assert (mori.cached(seq(0)), mori.cached(seq(100)), mori.cached(seq(200))) == (8, 8, 0)
    assert mori.evict(8) == 8  # then the idle program goes, before the busy one
    assert (mori.cached(seq(0)), mori.cached(seq(100))) == (8, 0)


def test_unowned_pages_go_first(mori: Tree) -> None:
    mori.run("busy", seq(0))
    mori.run(None, seq(300))  # a request that did not come through the gateway
    mori.run("idle", seq(100))
    mori.label(busy="busy", idle="idle")
    assert mori.evict(8) == 8
    assert (mori.cached(seq(300)), mori.cached(seq(0)), mori.cached(seq(100))) == (0, 8, 8)


def test_without_labels_the_order_is_sglangs_lru(mori: Tree) -> None:
    stock = build_tree(None)
    for tree in (mori, stock):
        _three_programs(tree)
        tree.evict(8)
    state = [(t.cached(seq(0)), t.cached(seq(100)), t.cached(seq(200))) for t in (mori, stock)]
    assert state[0] == state[1] == (0, 8, 8)
    # a gateway that clears the table brings the LRU back
    mori.label(busy="busy", idle="inactive")
    mori.cache.mori_apply([Message("clear")])
    mori.run("busy", seq(0))
    mori.run("idle", seq(100))  # the inactive program's pages are now the oldest
    assert mori.evict(8) == 8
    assert (mori.cached(seq(200)), mori.cached(seq(0)), mori.cached(seq(100))) == (0, 8, 8)


def test_drop_makes_a_program_go_first(mori: Tree) -> None:
    _three_programs(mori)
    mori.label(busy="busy", idle="idle", inactive="busy")
    mori.cache.mori_apply([Message("drop", program="idle")])
    assert mori.evict(8) == 8
    assert (mori.cached(seq(0)), mori.cached(seq(100)), mori.cached(seq(200))) == (8, 0, 8)


def test_host_tier_follows_moris_order() -> None:
    """With HiCache (write-back), evicted pages go to the host; when the host tier must
    make room, MORI drops the inactive program's copy first and keeps the idle one's,
    where SGLang's LRU drops the oldest."""
    trees = {name: build_tree(name, hicache=True) for name in ("mori", None)}
    try:
        for tree in trees.values():
            _three_programs(tree)
            assert tree.evict(24) == 24  # all three to the host
            tree.cache.writing_check(write_back=True)
            assert [tree.on_host(seq(s)) for s in (0, 100, 200)] == [8, 8, 8]
        trees["mori"].label(busy="busy", idle="idle", inactive="inactive")
        for tree in trees.values():
            assert tree.cache.evict_host(8) == 8
        mori, stock = trees["mori"], trees[None]
        assert [stock.on_host(seq(s)) for s in (0, 100, 200)] == [0, 8, 8]
        assert [mori.on_host(seq(s)) for s in (0, 100, 200)] == [8, 8, 0]
        assert mori.cache.evict_host(8) == 8  # then the busy program's copy, before idle's
        assert [mori.on_host(seq(s)) for s in (0, 100)] == [0, 8]
    finally:
        trees["mori"].cache.mori_close()
        for tree in trees.values():
            tree.cache.release_host_resources()


def test_the_gateway_drives_the_labels_over_the_channel(mori: Tree) -> None:
    server = mori.cache.mori_server
    assert server is not None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(server.endpoint)
    try:
        def ask(msg: object) -> dict[str, object]:
            sock.send(json.dumps(msg).encode() if not isinstance(msg, bytes) else msg)
            return json.loads(sock.recv())  # type: ignore[no-any-return]

        hello = ask({"v": 1, "op": "hello"})
        assert hello["ok"] and hello["block_size"] == 4 and hello["gpu_blocks"] == 16
        assert hello["cpu_tier_tokens"] == 0 and hello["programs"] == 0
        bad = ask(b"{not json")
        assert bad["ok"] is False  # logged and answered, never raised into SGLang
        assert ask({"v": 1, "op": "explode"})["ok"] is False
        _three_programs(mori)
        assert ask({"v": 1, "op": "replace", "labels": {
            "busy": "busy", "idle": "idle", "inactive": "inactive",
            "never-seen": "idle"}})["ok"]
        assert mori.evict(8) == 8  # the scheduler applies the labels before evicting
        assert (mori.cached(seq(0)), mori.cached(seq(200))) == (8, 0)
        assert ask({"v": 1, "op": "hello"})["programs"] == 4  # the unknown one kept
    finally:
        sock.close()
        ctx.term()


def test_tensor_parallel_engines_keep_sglangs_order(mori: Tree) -> None:
    mori.cache.mori_close()
    assert mori.cache.mori_start(tp_size=2) is False
    assert mori.cache.mori_server is None


def test_the_gateways_adapter_drives_the_plugin(mori: Tree) -> None:
    """MORI's own SGLang adapter (``labels=ENDPOINT``) against the plug-in in this cache:
    the handshake, labels as the policy issues them, a restart of the engine's side
    (a new plug-in instance with no labels) answered with the full table."""
    import asyncio

    from mori.core.types import Capability, KVLabel
    from mori.engines.sglang import SGLangAdapter

    server = mori.cache.mori_server
    assert server is not None
    _three_programs(mori)

    async def go() -> None:
        a = SGLangAdapter("http://127.0.0.1:9", labels=server.endpoint, labels_timeout_s=2.0,
                          labels_check_s=60.0)
        try:
            assert await a.check_labels()  # the handshake
            assert a.supports(Capability.LABELS) and a.supports(Capability.DROP)
            await a.set_label("busy", KVLabel.BUSY)
            await a.set_label("idle", KVLabel.IDLE)
            await a.release("inactive")  # released: inactive
            assert mori.evict(8) == 8
            assert (mori.cached(seq(0)), mori.cached(seq(100)), mori.cached(seq(200))) == (
                8, 8, 0)
            # the engine restarts its plug-in: a new instance, an empty table
            mori.cache.mori_close()
            mori.cache.mori_labels.clear()
            assert mori.cache.mori_start(endpoint=server.endpoint)
            # the adapter's checks (every labels_check_s) find it again: a message sent
            # while the socket reconnects may time out, the next check gets through
            answered = [await a.check_labels() for _ in range(3)]
            assert answered[-1] and a.link is not None and a.link.connections >= 1
            assert mori.evict(8) == 8  # applied before the eviction: idle goes, not busy
            assert (mori.cached(seq(0)), mori.cached(seq(100))) == (8, 0)
        finally:
            await a.close()
    asyncio.run(go())


def test_residency_is_read_from_the_tree_by_the_gateways_adapter() -> None:
    """The plug-in answers ``residency`` from its tree: per program the tokens on the GPU
    and those only on HiCache's host tier; MORI's adapter reads it (a restarted gateway
    puts programs back where their KV is)."""
    import asyncio

    from mori.core.types import Capability
    from mori.engines.sglang import SGLangAdapter

    tree = build_tree("mori", hicache=True)
    try:
        _three_programs(tree)
        tree.label(busy="busy", idle="idle", inactive="inactive")
        assert tree.evict(8) == 8  # the inactive program's pages go to the host
        tree.cache.writing_check(write_back=True)
        direct = tree.cache.mori_residency()
        assert direct == {"gpu": {"busy": 8, "idle": 8}, "cpu": {"inactive": 8},
                          "inactive": ["inactive"]}
        server = tree.cache.mori_server
        assert server is not None

        async def go() -> None:
            a = SGLangAdapter("http://127.0.0.1:9", labels=server.endpoint,
                              labels_timeout_s=2.0, labels_check_s=60.0)
            try:
                assert await a.check_labels()
                assert a.supports(Capability.RESIDENCY)  # without KV events: the plug-in
                res = await a.residency()
                assert res.gpu_tokens == {"busy": 8, "idle": 8}
                assert res.cpu_tokens == {"inactive": 8}
                assert res.ended == frozenset({"inactive"})
            finally:
                await a.close()
        asyncio.run(go())
    finally:
        tree.cache.mori_close()
        tree.cache.release_host_resources()
