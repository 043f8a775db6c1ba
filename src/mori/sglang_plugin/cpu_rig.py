"""SGLang's own cache classes on CPU pools, driven as SGLang's scheduler drives them: the
rig of the SGLang plug-in's tests (``tests/sglang_inside``) and of
``bench/bench_sglang_order.py``. Never imported by the plug-in itself.

SGLang's server does not start on a CPU, but its cache does: :func:`build_tree` builds
it through SGLang's registry (``--radix-cache-backend NAME``, or SGLang's default) on CPU
pools; :class:`Tree` runs requests through it (matched, computed, checkpointed into the
tree, released, as the scheduler does) and evicts. HiCache on a CPU needs three
stand-ins (:func:`cpu_hicache_shims`): host memory allocated plainly (no
``cudaHostRegister``), a pure-torch ``transfer_kv_direct`` and a no-op
``torch.cpu.Stream.synchronize``. They replace GPU plumbing, not the cache's logic.
"""

from __future__ import annotations

import atexit
import itertools
from array import array
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.events import KvEventLoraNames
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from mori.plugin_channel.protocol import Message

from . import backend
from .order import routing_key

PAGE = 4
LAYERS, HEADS, HEAD_DIM = 2, 2, 4
_rids = itertools.count()


def cpu_hicache_shims() -> None:
    """HiCache's GPU plumbing replaced for CPU tensors (module doc)."""
    from sglang.srt.mem_cache.pool_host import common as host_common
    from sglang.srt.mem_cache.pool_host import mha as host_mha

    def alloc_plain(dims: Any, dtype: Any, device: Any, pin_memory: Any, allocator: Any,
                    registration_granularity_bytes: Any = None) -> Any:
        return allocator.allocate(dims, dtype=dtype, device=device)

    def transfer_kv_direct(src_layers: Any, dst_layers: Any, src_indices: Any,
                           dst_indices: Any, page_size: int) -> None:
        src, dst = src_indices.to(torch.int64), dst_indices.to(torch.int64)
        for s, d in zip(src_layers, dst_layers, strict=True):
            d[dst] = s[src]

    host_common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain
    host_mha.transfer_kv_direct = transfer_kv_direct
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None


class _TpWorker:
    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        self.counter = counter


@dataclass
class Tree:
    """A radix cache built by SGLang's registry on CPU pools, and helpers that drive it as
    SGLang's scheduler does."""

    cache: Any
    allocator: Any
    req_pool: Any
    hits: int = 0  # prompt tokens found on the device, over every run
    prompts: int = 0  # prompt tokens, over every run

    def run(self, program: str | None, tokens: list[int]) -> Any:
        """One request of ``program`` (None: no routing key) over ``tokens``, as SGLang's
        scheduler runs it: matched against the tree (the matched prefix locked and
        protected), room made by eviction, its missing KV computed, checkpointed into
        the tree, then released."""
        req = Req(rid=f"r{next(_rids)}", origin_input_text="",
                  origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
                  routing_key=None if program is None else routing_key(program))
        self.req_pool.alloc([req])
        req.output_ids = array("q")
        req.full_untruncated_fill_ids = array("q", tokens)
        req.extend_end = len(tokens)
        req.lock = None
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)),
                                                          req=req))
        cached = int(match.device_prefix_len)
        req.last_node = match.last_device_node
        req.kv.cache_protected_len = cached  # the tree's own pages: not the request's
        req.lock = self.cache.lock(req.last_node)
        self.hits += cached
        self.prompts += len(tokens)
        prefix = self.cache.path_device_indices(match.last_device_node)
        need = len(tokens) - cached
        if self.allocator.available_size() < need:  # the scheduler evicts to make room
            self.evict(need - self.allocator.available_size())
        fresh = self.allocator.alloc(need)
        assert fresh is not None, "the device pool is full"
        kv = torch.cat([prefix[:cached], fresh])
        self.req_pool.write((req.kv.req_pool_idx, slice(0, len(tokens))), kv)
        req.kv.kv_committed_len = len(tokens)
        self.cache.checkpoint(req, up_to=len(tokens))
        self.cache.unlock(req.lock)
        self.req_pool.free(req)
        return req

    def cached(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` are on the device."""
        return int(self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len)

    def on_host(self, tokens: list[int]) -> int:
        """How many tokens past the device prefix are on the host tier."""
        return int(self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(array("q", tokens)))).host_hit_length)

    def evict(self, tokens: int) -> int:
        return int(self.cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted)

    def label(self, **labels: str) -> None:
        """Labels as the gateway sends them, applied as the scheduler applies them."""
        self.cache.mori_apply([Message("set", labels=dict(labels))])


def build_tree(backend_name: str | None, *, hicache: bool = False, device_tokens: int = 64,
               eviction: str = "lru", page: int = PAGE) -> Tree:
    """A cache as ``--radix-cache-backend backend_name`` (None: SGLang's default) builds
    it, on CPU pools of ``device_tokens`` (and a host tier twice that with HiCache)."""
    backend.register()
    if hicache:
        cpu_hicache_shims()
    args = ServerArgs(model_path="dummy", device="cpu", page_size=page,
                      radix_cache_backend=backend_name, radix_eviction_policy=eviction,
                      enable_hierarchical_cache=hicache, hicache_io_backend="direct",
                      hicache_mem_layout="layer_first", hicache_write_policy="write_back",
                      hicache_ratio=2.0)
    set_global_server_args_for_scheduler(args)
    req_pool = ReqToTokenPool(size=16, max_context_len=1024, device="cpu",
                              enable_memory_saver=False)
    kv = MHATokenToKVPool(size=device_tokens, page_size=page, dtype=torch.float16,
                          head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                          enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=device_tokens, page_size=page,
                                            dtype=torch.float16, device="cpu", kvcache=kv,
                                            need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool,
                             token_to_kv_pool_allocator=allocator, page_size=page,
                             eviction_policy=eviction, kv_event_lora_names=KvEventLoraNames())
    ctx = TreeCacheBuildContext(server_args=args, params=params, is_hybrid_swa=False,
                                is_hybrid_ssm=False, enable_hierarchical_cache=hicache,
                                disable_radix_cache=False, tp_worker=_TpWorker(),
                                model_config=None, tp_size=1, tp_rank=0, tp_group=None)
    cache = create_tree_cache(ctx)
    if hicache:
        atexit.unregister(cache.shutdown)
        cache.load_back_threshold = 0
    return Tree(cache, allocator, req_pool)
