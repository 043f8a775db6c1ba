"""The vLLM 0.32 internals the MORI plug-in relies on, pinned.

The plug-in reaches into vLLM where no public API exists (ENGINES.md, "Where MORI can
plug into vLLM 0.32 without forking"). When vLLM is upgraded, a failure here names what
moved; fix the plug-in (``src/mori/vllm_plugin``) before updating the pins.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import vllm

from mori.vllm_plugin.typed_queue import QUEUE_ATTRIBUTES, QUEUE_METHODS, TypedFreeBlockQueue

VLLM_SRC = Path(vllm.__file__).parent
PINNED_VERSION = "0.32."
# FreeKVCacheBlockQueue's own attributes that nothing outside it uses (so the typed queue
# does not have them)
QUEUE_INTERNALS = {"fake_free_list_head", "fake_free_list_tail"}


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


def test_vllm_version_is_the_one_verified() -> None:
    assert vllm.__version__.startswith(PINNED_VERSION), (
        f"vLLM {vllm.__version__} is installed; the plug-in is verified against "
        f"{PINNED_VERSION}x: re-check the internals pinned here, then update PINNED_VERSION")


def test_free_queue_method_set() -> None:
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
    theirs = _public_methods(FreeKVCacheBlockQueue)
    assert theirs == set(QUEUE_METHODS), (
        f"vLLM's FreeKVCacheBlockQueue methods changed: new {sorted(theirs - set(QUEUE_METHODS))}, "
        f"gone {sorted(set(QUEUE_METHODS) - theirs)}; TypedFreeBlockQueue must follow")
    for name in QUEUE_METHODS:
        ours = inspect.signature(getattr(TypedFreeBlockQueue, name))
        ref = inspect.signature(getattr(FreeKVCacheBlockQueue, name))
        assert list(ours.parameters) == list(ref.parameters), (
            f"FreeKVCacheBlockQueue.{name}{ref} but TypedFreeBlockQueue.{name}{ours}")
    instance = FreeKVCacheBlockQueue([])
    attrs = set(vars(instance)) if hasattr(instance, "__dict__") else set()
    assert attrs == set(QUEUE_ATTRIBUTES) | QUEUE_INTERNALS, (
        f"FreeKVCacheBlockQueue's attributes are now {sorted(attrs)}; the typed queue has "
        f"{sorted(QUEUE_ATTRIBUTES)} (+ internals {sorted(QUEUE_INTERNALS)})")
    for name in QUEUE_ATTRIBUTES:
        assert hasattr(TypedFreeBlockQueue([]), name)


def test_every_use_of_the_free_queue_in_vllm_is_covered() -> None:
    """Scan vLLM's source for ``free_block_queue.X`` / ``free_queue.X``."""
    used: dict[str, set[str]] = {}
    pat = re.compile(r"\bfree_(?:block_)?queue\.(\w+)")
    for path in VLLM_SRC.rglob("*.py"):
        if path.name == "kv_cache_utils.py" and path.parent.name == "core":
            continue  # the queue's own module
        for name in pat.findall(path.read_text(errors="replace")):
            used.setdefault(name, set()).add(str(path.relative_to(VLLM_SRC)))
    missing = {n: sorted(f) for n, f in used.items()
               if n not in QUEUE_METHODS and n not in QUEUE_ATTRIBUTES}
    assert not missing, f"vLLM now uses free-queue members the typed queue lacks: {missing}"
    assert {"popleft", "popleft_n", "remove", "append_n", "prepend_n",
            "num_free_blocks"} <= used.keys(), (
        f"BlockPool no longer uses the free queue as pinned (it uses {sorted(used)}): the "
        "typed queue may no longer be in the eviction path")


def test_block_pool() -> None:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    params = list(inspect.signature(BlockPool.__init__).parameters)
    assert params[:4] == ["self", "num_gpu_blocks", "enable_caching", "hash_block_size"], (
        f"BlockPool.__init__ is now {params}")
    pool = BlockPool(4, True, 16)
    assert hasattr(pool, "free_block_queue"), "BlockPool.free_block_queue moved"
    assert len(pool.blocks) == 4 and pool.null_block is pool.blocks[0]
    assert pool.get_num_free_blocks() == pool.free_block_queue.num_free_blocks == 3
    sig = inspect.signature(BlockPool.evict_blocks)
    assert list(sig.parameters) == ["self", "block_ids"], (
        f"BlockPool.evict_blocks is now {sig} (the plug-in's 'drop' uses it)")
    for name in ("get_new_blocks", "free_blocks", "touch", "cache_full_blocks",
                 "reset_prefix_cache", "get_cached_block"):
        assert callable(getattr(BlockPool, name, None)), f"BlockPool.{name} is gone"
    blk = KVCacheBlock(0)
    for name in ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block",
                 "is_null"):
        assert hasattr(blk, name), f"KVCacheBlock.{name} is gone"


def test_request_session_id() -> None:
    from vllm.v1.request import Request
    assert "session_id" in inspect.signature(Request.__init__).parameters, (
        "vllm.v1.request.Request no longer takes session_id: blocks cannot be tied to "
        "programs")
    from .conftest import HASHER, SamplingParams
    req = Request("x", [1, 2, 3, 4], SamplingParams(max_tokens=1), None,
                  block_hasher=HASHER, session_id="prog")
    assert req.session_id == "prog"


@pytest.mark.parametrize("module, name", [
    ("vllm.v1.core.sched.scheduler", "Scheduler"),
    ("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
])
def test_scheduler_classes(module: str, name: str) -> None:
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{module}.{name} is gone ({e}): the plug-in's scheduler imports it",
                    pytrace=False)
    if name.endswith("Scheduler"):
        for meth in ("schedule", "update_from_output", "reset_prefix_cache", "shutdown"):
            assert callable(getattr(cls, meth, None)), f"{name}.{meth} is gone"
    else:
        for meth in ("get_blocks", "evict_blocks"):
            assert callable(getattr(cls, meth, None)), f"KVCacheManager.{meth} is gone"


def test_scheduler_cls_is_resolved_by_qualified_name() -> None:
    from vllm.config import SchedulerConfig
    assert "scheduler_cls" in SchedulerConfig.__dataclass_fields__, (
        "SchedulerConfig.scheduler_cls (--scheduler-cls) is gone")
    src = inspect.getsource(SchedulerConfig.get_scheduler_cls)
    assert "resolve_obj_by_qualname" in src, "--scheduler-cls is no longer a qualified name"
