"""Tests that run inside SGLang's own venv (SGLang 0.5.23 on CPU tensors, no server):
the MORI plug-in's radix-cache backend on SGLang's real cache classes.

SGLang's server does not start on these CPUs (``shared/ENGINES.md``: its CPU backend
needs sgl-kernel ops PyPI does not ship), so the tests build SGLang's
``UnifiedRadixCache`` (and HiCache's host tier) through its own registry with CPU pools,
and drive them as the scheduler does: requests matched and checkpointed into the tree
(``mem_cache.common.match_kv_cache``, ``cache.checkpoint``), evictions. Run them with
that venv's python from the repository root::

    PYTHONPATH=src ~/.cache/mori/sglang-venv/bin/python -m pytest -q tests/sglang_inside

(``tests/e2e/test_sglang_plugin_unit.py`` does so from the main suite; the venv comes
from ``scripts/sglang_cpu_env.sh``.) The main suite does not collect this folder.

HiCache on a CPU needs three test-only shims (:func:`cpu_hicache_shims`): host memory
allocated plainly (no ``cudaHostRegister``), a pure-torch ``transfer_kv_direct`` and a
no-op ``torch.cpu.Stream.synchronize``. They replace GPU plumbing, not the cache's logic.
"""

from __future__ import annotations

import atexit
import itertools
import os
import sys
import warnings
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("SGLANG_PLUGINS", "none")  # no installed plug-in is loaded by surprise
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.events import KvEventLoraNames  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

from mori.sglang_plugin import backend  # noqa: E402
from mori.sglang_plugin.order import routing_key  # noqa: E402
from mori.vllm_plugin.protocol import Message  # noqa: E402

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
    reqs: list[Any] = field(default_factory=list)

    def run(self, program: str | None, tokens: list[int]) -> Any:
        """One request of ``program`` (None: no routing key) over ``tokens``: matched
        against the tree, its KV computed for the rest, checkpointed into the tree, then
        released."""
        req = Req(rid=f"r{next(_rids)}", origin_input_text="",
                  origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
                  routing_key=None if program is None else routing_key(program))
        self.req_pool.alloc([req])
        req.output_ids = array("q")
        req.full_untruncated_fill_ids = array("q", tokens)
        req.extend_end = len(tokens)
        req.last_node = self.cache.root_node_handle()
        req.kv.cache_protected_len = 0
        req.lock = None
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)),
                                                          req=req))
        cached = match.device_prefix_len
        prefix = self.cache.path_device_indices(match.last_device_node)
        fresh = self.allocator.alloc(len(tokens) - cached)
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
               eviction: str = "lru") -> Tree:
    """A cache as ``--radix-cache-backend backend_name`` (None: SGLang's default) builds
    it, on CPU pools of ``device_tokens`` (and a host tier twice that with HiCache)."""
    backend.register()
    if hicache:
        cpu_hicache_shims()
    args = ServerArgs(model_path="dummy", device="cpu", page_size=PAGE,
                      radix_cache_backend=backend_name, radix_eviction_policy=eviction,
                      enable_hierarchical_cache=hicache, hicache_io_backend="direct",
                      hicache_mem_layout="layer_first", hicache_write_policy="write_back",
                      hicache_ratio=2.0)
    set_global_server_args_for_scheduler(args)
    req_pool = ReqToTokenPool(size=16, max_context_len=1024, device="cpu",
                              enable_memory_saver=False)
    kv = MHATokenToKVPool(size=device_tokens, page_size=PAGE, dtype=torch.float16,
                          head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                          enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=device_tokens, page_size=PAGE,
                                            dtype=torch.float16, device="cpu", kvcache=kv,
                                            need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_pool,
                             token_to_kv_pool_allocator=allocator, page_size=PAGE,
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


def seq(start: int, n: int = 8) -> list[int]:
    """``n`` tokens (two pages) from ``start``."""
    return list(range(start, start + n))


@pytest.fixture(autouse=True)
def _labels_on_a_free_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every cache the tests build binds its own label endpoint."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MORI_LABEL_ENDPOINT", f"tcp://127.0.0.1:{port}")
    yield
