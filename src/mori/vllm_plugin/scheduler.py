"""vLLM schedulers that evict KV blocks by MORI's labels.

Load one with ``--scheduler-cls``: ``mori.vllm_plugin.scheduler.MoriScheduler`` on the CPU
build (the CPU platform turns async scheduling off), ``MoriAsyncScheduler`` where vLLM
schedules asynchronously (GPU). ``mori`` must be importable in the engine process
(installed, or on ``PYTHONPATH``). The label endpoint it binds: ``--additional-config
'{"mori_label_endpoint": "tcp://127.0.0.1:5558"}'`` or ``$MORI_LABEL_ENDPOINT``; the
secret every label message is signed with: ``"mori_label_secret_file": PATH`` there, or
``$MORI_LABEL_SECRET_FILE`` (required off loopback: the engine refuses to start without
it; ``mori vllm-args --label-secret-file`` prints the flags).

What the mixin adds to vLLM's scheduler:

- at construction, the block pool's ``free_block_queue`` is replaced by a
  :class:`~mori.vllm_plugin.typed_queue.TypedFreeBlockQueue` holding the same free blocks
  (in the same order within each list), and the label channel's server thread starts
  (:mod:`mori.plugin_channel.server`);
- at the start of each ``schedule()``, the label operations received since the last step
  are applied (the free blocks whose label changed move between lists; a ``drop`` evicts
  the program's unshared, unheld cached blocks through ``BlockPool.evict_blocks``);
- after each ``schedule()``, the blocks of the running requests are tied to their programs
  (``Request.session_id``), incrementally;
- ``reset_prefix_cache`` forgets every block's programs and re-sorts the free queue;
  ``shutdown`` stops the server.

With MORI's CPU tier (``--kv-transfer-config`` from ``mori vllm-args --cpu-gib``; the
cache policy ``cpu_tier.MoriCachePolicy`` is built inside ``Scheduler.__init__``, by the
offloading connector), the mixin also:

- binds that policy to its label table (``LabelTable.label``), relabels the host chunks of
  the programs a label message names (all of them for ``replace`` and ``clear``) and marks
  a dropped program's host chunks ``inactive``; tells it whether the tier is no larger
  than the GPU pool (``MoriCachePolicy.set_mirror_only``);
- copies each arriving request's ``session_id`` into its ``kv_transfer_params``
  (``connector_config.PROGRAM_KEY``), which is all the connector shows the policy of a
  request, before vLLM's ``add_request`` hands the request to the connector;
- reports the tier's size in tokens in the handshake (``cpu_tier_tokens``).

With MORI's disk tier behind it (``mori vllm-args --disk-gib N --disk-dir PATH``: vLLM's
tiering spec with ``disk_tier.MoriDiskTier`` as a secondary tier), the mixin binds each
disk tier to the same label table, passes drops on to it, reports its size in the
handshake (``disk_tier_tokens``) and its chunks per program in ``residency`` (``disk``).

An error in MORI's own bookkeeping is logged and never stops the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from mori.plugin_channel.labels import LabelTable
from mori.plugin_channel.protocol import Message
from mori.plugin_channel.server import configured_server

from . import compat
from .connector_config import PROGRAM_KEY, tokens_per_chunk
from .typed_queue import QUEUE_METHODS, TypedFreeBlockQueue

logger = logging.getLogger("vllm.mori_plugin.scheduler")

LOG_EVERY_S = 5.0  # at most one INFO line about applied labels per this many seconds


class MoriSchedulerMixin:
    """The MORI additions; mixed in before a vLLM ``Scheduler`` class."""

    # provided by vLLM's Scheduler
    kv_cache_manager: Any
    running: list[Any]
    block_size: int
    kv_cache_config: Any
    vllm_config: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _check_vllm()  # refuse a vLLM whose internals the plug-in does not know
        before = set(_cpu_policies())
        disks_before = set(_disk_tiers())
        super().__init__(*args, **kwargs)
        self.mori_labels = LabelTable()
        # the CPU tier's cache policies built by this scheduler's connector (none without)
        self.mori_cpu_policies = [p for p in _cpu_policies() if p not in before]
        for policy in self.mori_cpu_policies:
            policy.bind(self.mori_labels.label)
        self.mori_cpu_tier_tokens = self._mori_cpu_tier_tokens()
        # a host tier no larger than the GPU pool only mirrors it: the gateway parks
        # nothing there, and the chunks of programs it demoted are kept by recency
        pool_tokens = int(self.kv_cache_config.num_blocks) * int(self.block_size)
        self.mori_cpu_mirror_only = 0 < self.mori_cpu_tier_tokens <= pool_tokens
        for policy in self.mori_cpu_policies:
            policy.set_mirror_only(self.mori_cpu_mirror_only)
        # the disk tiers built by this scheduler's connector (none without)
        self.mori_disk_tiers = [t for t in _disk_tiers() if t not in disks_before]
        for tier in self.mori_disk_tiers:
            tier.bind(self.mori_labels.label)
        self._mori_learned: dict[tuple[str, int], tuple[int, int]] = {}
        self.mori_request_fields = request_fields()
        self._mori_log_at = 0.0
        self._mori_counts: dict[str, int] = {}
        pool = self.kv_cache_manager.block_pool
        self.mori_queue = TypedFreeBlockQueue.replacing(
            pool.free_block_queue, label_of=self.mori_labels.label_of,
            on_pop=self._mori_on_pop)
        pool.free_block_queue = self.mori_queue
        rank = int(getattr(self.vllm_config.parallel_config, "data_parallel_rank", 0) or 0)
        extra = getattr(self.vllm_config, "additional_config", None)
        # a secret that cannot be read, or an endpoint others reach without one: the
        # engine refuses to start (ValueError saying how to fix it)
        self.mori_server = configured_server(
            self._mori_info, rank=rank, config=extra if isinstance(extra, dict) else None,
            residency=self._mori_residency,
            logger=logging.getLogger("vllm.mori_plugin.server"))
        self.mori_server.start()
        logger.info("MORI scheduler: typed free queue over %d blocks (%d free); labels "
                    "from %s; CPU tier: %s", pool.num_gpu_blocks,
                    self.mori_queue.num_free_blocks, self.mori_server.endpoint,
                    f"{self.mori_cpu_tier_tokens} tokens in MORI's order"
                    + (" (no larger than the GPU pool: demoted programs' chunks kept by "
                       "recency)" if self.mori_cpu_mirror_only else "")
                    if self.mori_cpu_policies else "none")
        if self.mori_disk_tiers:
            logger.info("MORI scheduler: disk tier of %d tokens in MORI's order",
                        self._mori_disk_tier_tokens())

    # -- hooks into vLLM's scheduler ----------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._mori_apply_labels()
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._mori_learn_running()
        return out

    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self.mori_cpu_policies:
            try:
                program = getattr(request, "session_id", None)
                if isinstance(program, str) and program:
                    params = request.kv_transfer_params
                    params = dict(params) if isinstance(params, dict) else {}
                    params[PROGRAM_KEY] = program
                    request.kv_transfer_params = params
            except Exception:
                logger.exception("MORI scheduler: tagging a request with its program failed")
        return super().add_request(request, *args, **kwargs)  # type: ignore[misc]

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        ok = super().reset_prefix_cache(*args, **kwargs)  # type: ignore[misc]
        try:
            if ok:
                self.mori_labels.forget_all_blocks()
                self._mori_learned.clear()
            self.mori_queue.rebuild()
        except Exception:
            logger.exception("MORI scheduler: re-sorting the free queue after a reset failed")
        return ok

    def shutdown(self) -> None:
        try:
            self.mori_server.close()
        except Exception:
            logger.exception("MORI scheduler: closing the label channel failed")
        super().shutdown()  # type: ignore[misc]

    # -- MORI -------------------------------------------------------------------------------
    def _mori_info(self) -> dict[str, Any]:
        return {"block_size": int(self.block_size),
                "gpu_blocks": int(self.kv_cache_config.num_blocks),
                "cpu_tier_tokens": int(self.mori_cpu_tier_tokens),
                "disk_tier_tokens": self._mori_disk_tier_tokens(),
                "programs": len(self.mori_labels),
                **({} if self.mori_request_fields is None
                   else {"request_fields": list(self.mori_request_fields)})}

    def _mori_residency(self) -> dict[str, Any]:
        """The ``residency`` reply (on the label server's thread: reads copies only)."""
        blocks = self.kv_cache_manager.block_pool.blocks
        size = int(self.block_size)
        gpu = {p: n * size for p, n in
               self.mori_labels.held(lambda b: blocks[b].block_hash is not None).items()}
        cpu: dict[str, int] = {}
        for policy in self.mori_cpu_policies:
            for p, n in policy.chunks_held().items():
                cpu[p] = cpu.get(p, 0) + n * self.mori_chunk_tokens
        out: dict[str, Any] = {"gpu": gpu, "cpu": cpu,
                               "inactive": self.mori_labels.labelled("inactive")}
        if self.mori_disk_tiers:
            disk: dict[str, int] = {}
            for tier in self.mori_disk_tiers:
                for p, n in tier.chunks_held().items():
                    disk[p] = disk.get(p, 0) + n * self.mori_chunk_tokens
            out["disk"] = disk
        return out

    def _mori_disk_tier_tokens(self) -> int:
        """The disk tiers' size in tokens (0 without one)."""
        return sum(int(t.max_chunks) for t in self.mori_disk_tiers) * self.mori_chunk_tokens

    def _mori_cpu_tier_tokens(self) -> int:
        """The CPU tier's size in tokens (0 without one)."""
        self.mori_chunk_tokens = 0
        if not self.mori_cpu_policies:
            return 0
        try:
            kvt = getattr(self.vllm_config, "kv_transfer_config", None)
            extra = getattr(kvt, "kv_connector_extra_config", None)
            chunk = tokens_per_chunk(extra if isinstance(extra, dict) else None,
                                     int(self.block_size))
            self.mori_chunk_tokens = chunk
            return sum(int(p.cache_capacity) for p in self.mori_cpu_policies) * chunk
        except Exception:
            logger.exception("MORI scheduler: sizing the CPU tier failed; reporting 0")
            return 0

    def _mori_on_pop(self, block: Any) -> None:
        self.mori_labels.forget_block(block.block_id)

    def _mori_apply_labels(self) -> None:
        """Apply the label operations received since the last step."""
        try:
            msgs = self.mori_server.drain()
            if msgs:
                self._mori_apply(msgs)
        except Exception:
            logger.exception("MORI scheduler: applying labels failed")

    def _mori_apply(self, msgs: list[Message]) -> None:
        pool = self.kv_cache_manager.block_pool
        affected: set[int] = set()
        evicted = 0
        for msg in msgs:
            if msg.op == "set":
                affected |= self.mori_labels.set_labels(msg.labels or {})
            elif msg.op == "replace":
                affected |= self.mori_labels.replace(msg.labels or {})
            elif msg.op == "clear":
                affected |= self.mori_labels.clear()
            elif msg.op == "drop" and msg.program is not None:
                evict, more = self.mori_labels.drop(msg.program, pool.blocks)
                if evict:
                    self.kv_cache_manager.evict_blocks(evict)
                    evicted += len(evict)
                affected |= more
        moved = self.mori_queue.reclassify(pool.blocks[b] for b in affected)
        if self.mori_cpu_policies:
            self._mori_relabel_cpu(msgs)
        for msg in msgs:
            if msg.op == "drop" and msg.program is not None:
                for tier in self.mori_disk_tiers:
                    tier.drop(msg.program)
        c = self._mori_counts
        for msg in msgs:
            c[msg.op] = c.get(msg.op, 0) + 1
        c["moved"] = c.get("moved", 0) + moved
        c["evicted"] = c.get("evicted", 0) + evicted
        now = time.monotonic()
        if now - self._mori_log_at >= LOG_EVERY_S:
            self._mori_log_at = now
            logger.info("MORI labels applied: %s; %d programs labelled; free blocks by "
                        "class: %s", ", ".join(f"{k}={v}" for k, v in sorted(c.items())),
                        len(self.mori_labels), self.mori_queue.sizes())
            c.clear()
        else:
            logger.debug("MORI labels applied: %d messages, %d blocks moved, %d evicted",
                         len(msgs), moved, evicted)

    def _mori_relabel_cpu(self, msgs: list[Message]) -> None:
        """Move the host chunks whose class the label messages changed."""
        every = any(m.op in ("replace", "clear") for m in msgs)
        named: set[str] = set()
        for msg in msgs:
            if msg.op == "set":
                named |= set(msg.labels or {})
            elif msg.op == "drop" and msg.program is not None:
                for policy in self.mori_cpu_policies:
                    policy.drop(msg.program)
        for policy in self.mori_cpu_policies:
            if every:
                policy.relabel_all()
            elif named:
                policy.relabel(named)

    def _mori_learn_running(self) -> None:
        """Tie the running requests' new blocks to their programs."""
        try:
            learned: dict[tuple[str, int], tuple[int, int]] = {}
            old = self._mori_learned
            for req in self.running:
                program = getattr(req, "session_id", None)
                if not program:
                    continue
                rid = req.request_id
                groups = self.kv_cache_manager.get_blocks(rid).blocks
                for g, blocks in enumerate(groups):
                    n = len(blocks)
                    if n == 0:
                        continue
                    start = 0
                    seen = old.get((rid, g))
                    if seen is not None and 0 < seen[0] <= n \
                            and blocks[seen[0] - 1].block_id == seen[1]:
                        start = seen[0]
                    if start < n:
                        self.mori_labels.learn(
                            program, [b.block_id for b in blocks[start:] if not b.is_null])
                    learned[(rid, g)] = (n, blocks[n - 1].block_id)
            self._mori_learned = learned
        except Exception:
            logger.exception("MORI scheduler: learning the running requests' blocks failed")


def _check_vllm() -> None:
    """Raise :class:`~mori.vllm_plugin.compat.UnsupportedVllm` (one line) when the
    installed vLLM is not a release the plug-in knows, or its free-block queue, which the
    typed queue replaces, has members the typed queue lacks."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
    problems = [f"FreeKVCacheBlockQueue.{name} is new to the plug-in"
                for name in sorted(compat.public_methods(FreeKVCacheBlockQueue)
                                   - set(QUEUE_METHODS))]
    problems += compat.hook_problems(FreeKVCacheBlockQueue, TypedFreeBlockQueue,
                                     QUEUE_METHODS)
    compat.check(vllm.__version__, problems)


# The request fields through which the gateway names a request's program (and label)
REQUEST_FIELDS = ("session_id", "kv_hints")


def request_fields() -> tuple[str, ...] | None:
    """Which of :data:`REQUEST_FIELDS` this vLLM's OpenAI request models (chat and
    completions) both declare, i.e. read from a request's body: the gateway sends only
    those (the handshake's ``request_fields``). vLLM 0.32 to 0.34 declare ``session_id``
    and not ``kv_hints`` (which they fill through the Python API only); their models allow
    unknown fields (``extra="allow"``: ignored, not refused). ``None`` when the models
    cannot be imported: the handshake then says nothing and the gateway sends what suits
    0.32 to 0.34."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        models = (ChatCompletionRequest, CompletionRequest)
        return tuple(f for f in REQUEST_FIELDS
                     if all(f in m.model_fields for m in models))
    except Exception:
        logger.warning("MORI scheduler: vLLM's OpenAI request models did not load; the "
                       "handshake names no request fields", exc_info=True)
        return None


def _disk_tiers() -> list[Any]:
    """The disk tiers alive in this process (none when the module cannot load)."""
    try:
        from .disk_tier import live_tiers
    except Exception:
        return []
    return live_tiers()


def _cpu_policies() -> list[Any]:
    """The CPU tier's cache policies alive in this process (none when the tier's module
    cannot load: vLLM without the offloading classes)."""
    try:
        from .cpu_tier import live_policies
    except Exception:
        return []
    return live_policies()


class MoriScheduler(MoriSchedulerMixin, Scheduler):  # type: ignore[misc]
    """vLLM's synchronous ``Scheduler`` with MORI's typed eviction (the CPU build)."""


class MoriAsyncScheduler(MoriSchedulerMixin, AsyncScheduler):  # type: ignore[misc]
    """vLLM's ``AsyncScheduler`` with MORI's typed eviction (GPU engines)."""
