"""The radix-cache backend ``mori`` for SGLang (0.5.23): SGLang's own
``UnifiedRadixCache`` and tree core, with owners on the nodes and MORI's eviction order.

Imported inside SGLang's processes only: :func:`register` is the entry point
``mori = "mori.sglang_plugin.backend:register"`` of the group ``sglang.srt.plugins``,
which SGLang's launcher loads before it parses its flags, so ``--radix-cache-backend
mori`` is accepted (``mori sglang-args`` prints the flags).

- :class:`MoriTreeCore`: SGLang's Python tree core (custom eviction orders need it; the
  Rust core refuses them); a split node's new parent inherits the child's owners.
- :class:`MoriRadixCache`: tags a node with a request's program when the request is
  checkpointed into the tree (every node on its path) and when it matches a prefix
  (the matched path); its eviction strategy (:class:`MoriEviction`) orders nodes by
  ``mori.sglang_plugin.order.eviction_key``, on the GPU and, with HiCache, on the host
  tier. Labels arrive on the label channel (``mori.plugin_channel.server.LabelServer``,
  bound at ``$MORI_LABEL_ENDPOINT`` or ``tcp://127.0.0.1:5558``, signed with the secret of
  ``$MORI_LABEL_SECRET_FILE``, required off loopback) and are applied by the
  scheduler thread before each eviction. ``drop`` labels the program ``inactive`` (its
  nodes go first at the next eviction; SGLang gives no call that evicts one path now).
- Fault rules: a malformed message is answered ``ok: false`` and logged by the server,
  never raised here; a label for a program the engine has not seen is kept for when it
  comes; with tensor parallelism above 1 the plug-in does not start its channel (each TP
  rank holds a tree that must evict alike, and the labels reach one process) and the
  order stays SGLang's LRU on every rank.
- ``residency`` is answered from the tree (``MoriRadixCache.mori_residency``): what each
  program holds on the GPU and, only there, on the host tier; a restarted gateway reads
  it to put programs back where their KV is.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.mem_cache.evict_policy import EvictionStrategy
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_unified_radix_cache,
    register_radix_cache_backend,
    registered_radix_cache_backends,
)
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
    get_tree_core_factory,
    register_tree_core_backend,
)
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from mori.plugin_channel.labels import LabelTable
from mori.plugin_channel.protocol import Message
from mori.plugin_channel.server import LabelServer, configured_server

from .order import WIDE, add_owner, eviction_key, program_of

logger = logging.getLogger("sglang.mori_plugin")

BACKEND = "mori"
TREE_CORE = "mori-python"
SNAPSHOT_TRIES = 5


def owners_of(node: Any) -> set[str]:
    """The node's owner set (created empty on first use)."""
    owners: set[str] | None = getattr(node, "mori_owners", None)
    if owners is None:
        owners = set()
        node.mori_owners = owners
    return owners


class MoriTreeCore(UnifiedTreeCore):  # type: ignore[misc]
    """SGLang's Python tree core; a split keeps the owners on both halves."""

    def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
        new_node, action = super()._split_node(key, child, split_len)
        if getattr(child, "mori_owners", None):
            new_node.mori_owners = set(child.mori_owners)
        return new_node, action


class MoriEviction(EvictionStrategy):  # type: ignore[misc]
    """MORI's order (``order.eviction_key``); ``host`` is set while the host tier evicts."""

    def __init__(self, labels: LabelTable) -> None:
        self.labels = labels
        self.host = False

    def get_priority(self, node: Any) -> tuple[int, float]:
        return eviction_key(getattr(node, "mori_owners", ()), node.last_access_time,
                            self.labels, self.host)


class MoriRadixCache(UnifiedRadixCache):  # type: ignore[misc]
    """``UnifiedRadixCache`` with owners on its nodes and MORI's eviction order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mori_labels = LabelTable()
        self.mori_eviction = MoriEviction(self.mori_labels)
        self.tree_core.eviction_strategy = self.mori_eviction
        self.mori_server: LabelServer | None = None

    # -- the label channel --------------------------------------------------------------
    def mori_start(self, tp_size: int = 1, endpoint: str | None = None) -> bool:
        """Bind the label channel (False: not started, the order stays LRU). The endpoint
        and secret come from ``$MORI_LABEL_ENDPOINT`` and ``$MORI_LABEL_SECRET_FILE``
        (``endpoint`` overrides the first); a secret that cannot be read, or an endpoint
        others reach without one, raises ``ValueError``: the engine must not start so."""
        if tp_size > 1:
            logger.warning("MORI plug-in: tensor parallelism %d > 1 is not supported yet; "
                           "eviction stays SGLang's LRU", tp_size)
            return False
        self.mori_server = configured_server(
            self._mori_info, config={"mori_label_endpoint": endpoint} if endpoint else None,
            residency=self.mori_residency,
            logger=logging.getLogger("sglang.mori_plugin.server"))
        if not self.mori_server.start():
            self.mori_server = None
            return False
        logger.info("MORI plug-in: labels at %s", self.mori_server.endpoint)
        return True

    def mori_close(self) -> None:
        if self.mori_server is not None:
            self.mori_server.close()
            self.mori_server = None

    def _mori_info(self) -> dict[str, Any]:
        host = getattr(getattr(self, "cache_controller", None), "mem_pool_host", None)
        allocator = self.token_to_kv_pool_allocator
        page = max(1, int(self.page_size))
        return {"block_size": page, "gpu_blocks": int(allocator.size) // page,
                "cpu_tier_tokens": int(host.size) if host is not None else 0,
                "programs": len(self.mori_labels)}

    def mori_residency(self) -> dict[str, Any]:
        """The ``residency`` reply (on the label server's thread, while the scheduler may
        change the tree: a walk that meets a change is retried, then given up empty):
        per program, the tokens of its nodes on the GPU, and those only on the host tier
        (a write-through host copy of a GPU node is not counted twice)."""
        inactive = self.mori_labels.labelled("inactive")
        for _ in range(SNAPSHOT_TRIES):
            try:
                gpu, cpu = self._mori_walk()
            except (RuntimeError, KeyError, AttributeError):  # changed under the walk
                continue
            return {"gpu": gpu, "cpu": cpu, "inactive": inactive}
        return {"gpu": {}, "cpu": {}, "inactive": inactive}

    def _mori_walk(self) -> tuple[dict[str, int], dict[str, int]]:
        gpu: dict[str, int] = {}
        cpu: dict[str, int] = {}
        stack = list(self.tree_core.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(list(node.children.values()))
            owners = tuple(getattr(node, "mori_owners", ()))
            if not owners or WIDE in owners:
                continue
            data = node.component_data[ComponentType.FULL]
            held = gpu if data.value is not None else cpu if data.host_value is not None \
                else None
            if held is None:
                continue
            n = len(node.key)
            for program in owners:
                held[program] = held.get(program, 0) + n
        return gpu, cpu

    def mori_apply(self, msgs: list[Message]) -> None:
        """Apply label operations in order (the scheduler thread's job)."""
        for msg in msgs:
            if msg.op == "set":
                self.mori_labels.set_labels(msg.labels or {})
            elif msg.op == "replace":
                self.mori_labels.replace(msg.labels or {})
            elif msg.op == "clear":
                self.mori_labels.clear()
            elif msg.op == "drop" and msg.program is not None:
                self.mori_labels.set_labels({msg.program: "inactive"})

    def _mori_drain(self) -> None:
        if self.mori_server is not None:
            msgs = self.mori_server.drain()
            if msgs:
                self.mori_apply(msgs)

    # -- owners -------------------------------------------------------------------------
    def _mori_tag(self, node: Any, program: str) -> None:
        core = self.tree_core
        if isinstance(node, int):
            node = core.node_by_id(node)
        root = core.root_node
        while node is not None and node is not root:
            add_owner(owners_of(node), program)
            node = node.parent

    def match_prefix(self, params: Any) -> Any:
        result = super().match_prefix(params)
        req = getattr(params, "req", None)
        program = program_of(getattr(req, "routing_key", None))
        if program is not None and result.last_device_node is not None:
            self._mori_tag(result.last_device_node, program)
        return result

    def checkpoint_into_tree(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        super().checkpoint_into_tree(req, up_to=up_to, **kwargs)
        program = program_of(getattr(req, "routing_key", None))
        if program is not None and req.last_node is not None:
            self._mori_tag(req.last_node, program)

    # -- eviction -----------------------------------------------------------------------
    def _evict(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        self._mori_drain()
        return super()._evict(params, *args, **kwargs)

    def evict_host(self, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        self._mori_drain()
        self.mori_eviction.host = True
        try:
            return int(super().evict_host(num_tokens, *args, **kwargs))
        finally:
            self.mori_eviction.host = False


def build(ctx: TreeCacheBuildContext) -> MoriRadixCache:
    """The backend's factory: SGLang's unified radix cache (HiCache attached when enabled)
    as :class:`MoriRadixCache`, on :class:`MoriTreeCore`, its label channel started."""
    ctx.params.tree_core_backend = TREE_CORE
    cache = create_unified_radix_cache(ctx, cache_class=MoriRadixCache)
    assert isinstance(cache, MoriRadixCache)
    cache.mori_start(tp_size=int(getattr(ctx, "tp_size", 1) or 1))
    return cache


def register() -> None:
    """Register the tree core and the radix-cache backend ``mori`` (idempotent)."""
    if get_tree_core_factory(TREE_CORE) is None:
        register_tree_core_backend(TREE_CORE, lambda params, components:
                                   MoriTreeCore(params, components))
    if BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND, build)
