"""The vLLM internals the MORI plug-in relies on, pinned release by release (0.32 to 0.34).

The plug-in reaches into vLLM where no public API exists (docs/engines.md, "Where MORI
plugs into vLLM 0.32 without forking"). These tests run against each supported release
(``tests/e2e/test_vllm_plugin_unit.py``); what differs between releases is in
:data:`RELEASES`. When a new vLLM appears, a failure here names what moved. Re-check first
what moved last time: the host tier's ``CachePolicy`` (``v1/kv_offload/cpu/policies/base.py``
and ``lru.py``: 0.33 changed ``insert``, added ``on_request_access`` and re-ordered the
LRU; 0.34 removed ``touch`` and made ``on_request_finished`` abstract) and
``OffloadingWorker`` (``v1/kv_offload/base.py``: 0.33 added ``expedited``; 0.34 hands the
engine side of a transfer as ``DevicePointers``, not a ``GPULoadStoreSpec``). Fix the
plug-in (``src/mori/vllm_plugin``), then add the release to :data:`RELEASES` and to
``mori.vllm_plugin.compat.SUPPORTED``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import vllm

from mori.vllm_plugin import compat
from mori.vllm_plugin.typed_queue import QUEUE_ATTRIBUTES, QUEUE_METHODS, TypedFreeBlockQueue

VLLM_SRC = Path(vllm.__file__).parent

# What differs between the supported releases: the CachePolicy hooks (their parameters,
# and which are abstract) and the parameters of OffloadingWorker.submit_store/submit_load
# (the rest is pinned below, the same for every release).
_POLICY_032: dict[str, tuple[str, ...]] = {
    "get": ("self", "key"),
    "insert": ("self", "key", "chunk"),
    "remove": ("self", "key"),
    "touch": ("self", "keys", "req_context"),
    "on_store_miss": ("self", "keys", "req_context"),
    "on_request_finished": ("self", "key_groups", "insertion_only_keys", "reused_keys",
                            "req_context"),
    "mark_evictable": ("self", "key"),
    "mark_non_evictable": ("self", "key"),
    "evict": ("self", "n", "protected"),
    "clear": ("self",),
}
_POLICY_033 = {**_POLICY_032,
               "insert": ("self", "key", "chunk", "req_context"),
               "on_request_access": ("self", "keys", "req_context")}
_ABSTRACT_032 = {"get": (), "insert": (), "remove": (), "touch": (), "evict": (), "clear": ()}
RELEASES: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    "0.32": {
        "CachePolicy": _POLICY_032,
        "CachePolicy abstract": _ABSTRACT_032,
        "OffloadingWorker": {
            "submit_store": ("self", "job_id", "src_spec", "dst_spec"),
            "submit_load": ("self", "job_id", "src_spec", "dst_spec")},
    },
    "0.33": {
        "CachePolicy": _POLICY_033,
        "CachePolicy abstract": _ABSTRACT_032,
        "OffloadingWorker": {
            "submit_store": ("self", "job_id", "src_spec", "dst_spec"),
            "submit_load": ("self", "job_id", "src_spec", "dst_spec", "expedited")},
    },
    "0.34": {
        # touch is gone (recency is set by on_request_access and on_request_finished,
        # now abstract); the rest as 0.33
        "CachePolicy": {k: v for k, v in _POLICY_033.items() if k != "touch"},
        "CachePolicy abstract": {"get": (), "insert": (), "remove": (),
                                 "on_request_finished": (), "evict": (), "clear": ()},
        # the engine side is a DevicePointers (resolved by the connector's worker side)
        "OffloadingWorker": {
            "submit_store": ("self", "job_id", "device_ptrs", "dst_spec"),
            "submit_load": ("self", "job_id", "src_spec", "device_ptrs", "expedited")},
    },
}
RELEASE = compat.release(vllm.__version__) or vllm.__version__
# FreeKVCacheBlockQueue's own attributes that nothing outside it uses (so the typed queue
# does not have them)
QUEUE_INTERNALS = {"fake_free_list_head", "fake_free_list_tail"}


def _public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}


NEWEST = max(RELEASES, key=lambda r: tuple(int(x) for x in r.split(".")))


def _pins(kind: str) -> dict[str, tuple[str, ...]]:
    """This release's pins; a release not pinned here (a new one, as the canary
    ``scripts/vllm_canary.sh`` runs it) is held to the newest release's, so that a failure
    names what moved since (``test_vllm_release_is_one_verified`` fails for it anyway)."""
    return RELEASES.get(RELEASE, RELEASES[NEWEST])[kind]


def test_vllm_release_is_one_verified() -> None:
    assert set(RELEASES) == set(compat.SUPPORTED), (
        f"the pins here ({sorted(RELEASES)}) and the releases the plug-in accepts "
        f"(compat.SUPPORTED: {sorted(compat.SUPPORTED)}) differ")
    assert RELEASE in RELEASES, (
        f"vLLM {vllm.__version__} is installed; the plug-in is verified against "
        f"{', '.join(RELEASES)}: re-check the internals pinned here (CachePolicy and "
        "OffloadingWorker first), then add the release to RELEASES and compat.SUPPORTED")
    assert compat.refusal(vllm.__version__, env={}) is None


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


# -- the CPU tier (mori.vllm_plugin.cpu_tier) ---------------------------------------------
CPU_TIER = "mori.vllm_plugin.cpu_tier"
# CachePolicy (vllm/v1/kv_offload/cpu/policies/base.py): the abstract methods, and every
# method the manager calls (MoriCachePolicy overrides them all: a hook it does not override
# would run the base's default, which touches)
WORKER_ABSTRACT = {"submit_store", "submit_load", "get_finished", "wait"}


def _fields(cls: type) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {}))


def test_cache_policy_method_set() -> None:
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

    from mori.vllm_plugin.cpu_tier import MoriCachePolicy
    pins = _pins("CachePolicy")
    pinned_abstract = set(_pins("CachePolicy abstract"))
    abstract = set(CachePolicy.__abstractmethods__)
    assert abstract == pinned_abstract, (
        f"CachePolicy's abstract methods are now {sorted(abstract)} (pinned "
        f"{sorted(pinned_abstract)}): MoriCachePolicy must implement the new ones")
    theirs = _public_methods(CachePolicy)
    assert theirs == set(pins), (
        f"CachePolicy's methods changed in {vllm.__version__}: new "
        f"{sorted(theirs - set(pins))}, gone {sorted(set(pins) - theirs)}; MoriCachePolicy "
        "must follow")
    for name, params in pins.items():
        ref = inspect.signature(getattr(CachePolicy, name))
        assert tuple(ref.parameters) == params, (
            f"CachePolicy.{name} is now {ref} in {vllm.__version__} (pinned {params})")
        assert name in vars(MoriCachePolicy), f"MoriCachePolicy does not override {name}"
    # MoriCachePolicy takes every release's arguments (later ones optional)
    assert compat.hook_problems(CachePolicy, MoriCachePolicy, pins) == []
    for release in RELEASES.values():
        for name, params in release["CachePolicy"].items():
            ours = tuple(inspect.signature(getattr(MoriCachePolicy, name)).parameters)
            assert ours[:len(params)] == params, (
                f"MoriCachePolicy.{name}{ours} does not take {params}")
    params = list(inspect.signature(CachePolicy.__init__).parameters)
    assert params == ["self", "cache_capacity"], f"CachePolicy.__init__ is now {params}"
    src = inspect.getsource(importlib.import_module("vllm.v1.kv_offload.cpu.manager"))
    assert "policy_cls(cache_capacity=" in src, (
        "CPUOffloadingManager no longer builds its policy as policy_cls(cache_capacity=...)")
    chunk = ChunkStatus(3)
    assert (chunk.ref_cnt, chunk.chunk_id) == (-1, 3), "ChunkStatus's fields changed"
    from vllm.v1.kv_offload.cpu.policies.base import order_request_keys
    params = list(inspect.signature(order_request_keys).parameters)
    assert params == ["key_groups", "req_context"], f"order_request_keys is now {params}"


def test_req_context_carries_the_requests_kv_transfer_params() -> None:
    """The policy reads the program from ``ReqContext.kv_transfer_params``, which the
    offloading connector takes from ``Request.kv_transfer_params`` when the scheduler adds
    the request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as osched
    from vllm.v1.kv_offload.base import ReqContext

    from mori.vllm_plugin.cpu_tier import PROGRAM_KEY, program_of

    from .conftest import Request, SamplingParams
    fields = _fields(ReqContext)
    assert {"req_id", "kv_transfer_params"} <= fields, (
        f"ReqContext's fields are now {sorted(fields)}: the policy reads "
        "kv_transfer_params (and the tests build contexts with req_id)")
    ctx = ReqContext("r")
    ctx.set_state(1.5)
    assert ctx.get_state(float) == 1.5, "ReqContext.get_state/set_state changed"
    assert callable(getattr(osched, "_create_req_context", None)), (
        "offloading/scheduler.py's _create_req_context is gone: check where ReqContext "
        "gets kv_transfer_params now")
    made = list(inspect.signature(osched._create_req_context).parameters)
    assert made[0] == "req" and made[1:] in ([], ["scheduler"]), (
        f"offloading/scheduler.py's _create_req_context{made}: check how it is called")

    def create(req: Request) -> ReqContext:
        # 0.34 also takes the connector's scheduler (the context's token counts read it)
        return osched._create_req_context(req, *[None] * (len(made) - 1))

    params = {PROGRAM_KEY: "prog"}
    req = Request("x", [1, 2, 3, 4], SamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": params}), None)
    assert req.kv_transfer_params == params, (
        "Request no longer takes kv_transfer_params from sampling_params.extra_args")
    assert program_of(create(req)) == "prog", (
        "the offloading connector's ReqContext no longer carries the request's "
        "kv_transfer_params")
    req = Request("y", [1, 2, 3, 4], SamplingParams(max_tokens=1), None)
    req.kv_transfer_params = {PROGRAM_KEY: "set-later"}  # what add_request will do
    assert program_of(create(req)) == "set-later"
    from vllm.v1.core.sched.scheduler import Scheduler
    src = inspect.getsource(Scheduler.add_request)
    assert "connector.on_new_request(request)" in src, (
        "Scheduler.add_request no longer hands the request to the connector: the "
        "mori_program injection must happen before the connector first sees the request")


def test_offloading_spec_and_worker() -> None:
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        OffloadingSpec,
        OffloadingWorker,
        TransferResult,
    )
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from mori.vllm_plugin.host_tier import HostCopyOffloadingWorker, MoriHostOffloadingSpec
    abstract = set(OffloadingSpec.__abstractmethods__)
    assert abstract == {"get_manager", "get_worker"}, (
        f"OffloadingSpec's abstract methods are now {sorted(abstract)}")
    ref = inspect.signature(OffloadingSpec.get_worker)
    assert list(ref.parameters) == ["self", "kv_caches"], f"OffloadingSpec.get_worker{ref}"
    ours = inspect.signature(MoriHostOffloadingSpec.get_worker)
    assert list(ours.parameters) == list(ref.parameters), (
        f"OffloadingSpec.get_worker{ref} but MoriHostOffloadingSpec.get_worker{ours}")
    assert issubclass(MoriHostOffloadingSpec, CPUOffloadingSpec)
    src = (VLLM_SRC / "distributed/kv_transfer/kv_connector/v1/offloading/worker.py"
           ).read_text()
    assert "self.spec.get_worker(kv_caches)" in src, (
        "the offloading connector's worker side no longer gets its worker from "
        "spec.get_worker(kv_caches)")
    abstract = set(OffloadingWorker.__abstractmethods__)
    assert abstract == WORKER_ABSTRACT, (
        f"OffloadingWorker's abstract methods are now {sorted(abstract)} (were "
        f"{sorted(WORKER_ABSTRACT)}): HostCopyOffloadingWorker must follow")
    for name, pinned in _pins("OffloadingWorker").items():
        ref = inspect.signature(getattr(OffloadingWorker, name))
        assert tuple(ref.parameters) == pinned, (
            f"OffloadingWorker.{name} is now {ref} in {vllm.__version__} (pinned {pinned})")
    assert compat.hook_problems(OffloadingWorker, HostCopyOffloadingWorker,
                                WORKER_ABSTRACT) == []
    # The copy worker takes every release's arguments: by name where the name is the same
    # in every release, by position (positional-only) where it is not: the engine side
    # (0.32/0.33 src_spec/dst_spec, 0.34 device_ptrs) ...
    for name in ("submit_store", "submit_load"):
        ours = inspect.signature(getattr(HostCopyOffloadingWorker, name)).parameters
        mine = list(ours.values())
        for release in RELEASES.values():
            params = release["OffloadingWorker"][name]
            assert len(mine) >= len(params), f"HostCopyOffloadingWorker.{name}{ours}"
            for i, param in enumerate(params):
                same = {r["OffloadingWorker"][name][i] for r in RELEASES.values()
                        if i < len(r["OffloadingWorker"][name])}
                if len(same) == 1:
                    assert mine[i].name == param, (
                        f"HostCopyOffloadingWorker.{name}: parameter {i} is {mine[i].name}, "
                        f"not {param}")
                else:
                    assert mine[i].kind is inspect.Parameter.POSITIONAL_ONLY, (
                        f"HostCopyOffloadingWorker.{name}: parameter {i} is named {same} by "
                        "the releases: it must be positional only")
    # ... which vLLM's connector passes by position (the 0.34 call shown)
    src = (VLLM_SRC / "distributed/kv_transfer/kv_connector/v1/offloading/worker.py"
           ).read_text()
    calls = re.findall(r"self\.worker\.submit_(?:store|load)\(\s*([^)]*)\)", src)
    assert len(calls) >= 3, f"the connector's worker side submits differently now: {calls}"
    for args in calls:
        positional = [a.strip() for a in args.split(",") if a.strip() and "=" not in a]
        assert len(positional) >= 3, (
            f"the connector calls the offloading worker with {args!r}: the engine side must "
            "be passed by position (HostCopyOffloadingWorker takes it positional only)")
    for cls, needed in ((CanonicalKVCaches, {"tensors", "group_data_refs"}),
                        (CanonicalKVCacheTensor, {"tensor", "page_size_bytes"}),
                        (CanonicalKVCacheRef, {"tensor_idx", "page_size_bytes"}),
                        (TransferResult, {"job_id", "success", "transfer_size",
                                          "transfer_time"})):
        assert needed <= _fields(cls), (
            f"{cls.__name__}'s fields are now {sorted(_fields(cls))}; the copy worker reads "
            f"{sorted(needed)}")
    spec = GPULoadStoreSpec([4, 5], [2], [1])
    for name in ("block_ids", "group_sizes", "block_indices"):
        assert hasattr(spec, name), f"GPULoadStoreSpec.{name} is gone"


def _offloading_config(extra: dict[str, object]) -> object:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    try:
        return OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",),
                                          group_id=0),),
            worker_kv_bytes_per_block=4096, enable_kv_cache_events=False,
            extra_config=extra, engine_id="e",
            model=OffloadingModelConfig(name="m", dtype="float32"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1,
                data_parallel_rank_local=None, is_parallelism_agnostic=True))
    except TypeError as e:
        pytest.fail(f"vllm.v1.kv_offload.config's OffloadingConfig changed ({e})",
                    pytrace=False)


def test_offloading_factory_keys() -> None:
    """The ``kv_connector_extra_config`` keys that load the CPU tier (what
    ``connector_config.kv_transfer_config`` emits) still mean what they did."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from mori.vllm_plugin.connector_config import kv_transfer_config
    from mori.vllm_plugin.cpu_tier import MoriCachePolicy
    from mori.vllm_plugin.host_tier import MoriHostOffloadingSpec
    extra = kv_transfer_config(1 << 20)["kv_connector_extra_config"]
    assert set(extra) == {"cpu_bytes_to_use", "eviction_policy", "cache_policy_module_path",
                          "offload_prompt_only", "spec_name", "spec_module_path"}
    assert OffloadingSpecFactory.get_spec_cls(extra) is MoriHostOffloadingSpec, (
        "OffloadingSpecFactory.get_spec_cls no longer loads spec_name from spec_module_path")
    assert CachePolicyFactory.get_cache_policy_cls(
        "MoriCachePolicy", CPU_TIER) is MoriCachePolicy, (
        "CachePolicyFactory.get_cache_policy_cls no longer loads an out-of-tree policy "
        "from its module path")
    spec = OffloadingSpecFactory.create_spec(_offloading_config(extra))
    assert isinstance(spec, MoriHostOffloadingSpec)
    assert (spec.eviction_policy, spec.cache_policy_module_path) == (
        "MoriCachePolicy", CPU_TIER), (
        "CPUOffloadingSpec no longer reads eviction_policy / cache_policy_module_path")
    assert spec.num_chunks == (1 << 20) // 4096, (
        f"CPUOffloadingSpec sizes the tier differently from cpu_bytes_to_use now "
        f"({spec.num_chunks} chunks of 4096 bytes for 1 MiB)")
    assert spec.offload_prompt_only is False, "OffloadingSpec ignores offload_prompt_only"
    manager = spec.get_manager()
    assert isinstance(getattr(manager, "_policy", None), MoriCachePolicy), (
        "CPUOffloadingManager no longer keeps the configured policy as _policy")
    src = (VLLM_SRC / "distributed/kv_transfer/kv_connector/v1/offloading/config.py"
           ).read_text()
    assert 'extra_config.get("block_size")' in src, (
        "the offloading config no longer reads block_size (tokens per host chunk)")
