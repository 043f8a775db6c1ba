"""A host KV tier for vLLM's CPU build (0.32; 0.33 and 0.34 as source over it): a copy worker and the offloading spec using it.

vLLM's own ``CPUOffloadingWorker`` is CUDA/XPU only (``v1/kv_offload/cpu/spec.py:196-207``
refuses the CPU platform). :class:`HostCopyOffloadingWorker` copies between the engine's
KV cache tensors and host chunks with plain synchronous torch copies, in the byte layout
of vLLM's worker (direct layout); :class:`MoriHostOffloadingSpec` is vLLM's
``CPUOffloadingSpec`` with that worker, and :class:`MoriTieringOffloadingSpec` vLLM's
``TieringOffloadingSpec`` with it (a host tier with secondary tiers behind it: MORI's disk
tier, ``mori.vllm_plugin.disk_tier``). This exercises the CPU tier's control path on the
CPU build (it says nothing of transfer speed); on GPUs vLLM's own spec and worker are used.
The eviction order of the tier is ``mori.vllm_plugin.cpu_tier``'s.

This module imports vLLM (and torch); it is imported inside vLLM's processes only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import vllm
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from . import compat

logger = logging.getLogger("vllm.mori_plugin.host_tier")


class HostCopyOffloadingWorker(OffloadingWorker):  # type: ignore[misc]
    """An ``OffloadingWorker`` (``v1/kv_offload/base.py:568-592``) copying with plain,
    synchronous torch copies, for KV caches that live in host memory (vLLM's CPU build).

    Byte layout (that of ``CPUOffloadingWorker``'s direct layout,
    ``v1/kv_offload/cpu/gpu_worker.py:764-830``): for each canonical KV tensor ``t`` (viewed as
    ``(num_blocks, page_t)`` int8, ``page_t`` its padded page size), a host tensor
    ``(num_chunks, page_t * blocks_per_chunk)`` int8; chunk ``c`` holds
    ``blocks_per_chunk`` consecutive blocks of a request, block ``j`` of the chunk at bytes
    ``[j * page_t, (j + 1) * page_t)``. A transfer whose first block is not chunk aligned
    (``GPULoadStoreSpec.block_indices[g] % blocks_per_chunk``) skips that many sub-blocks of
    its first chunk, per group (``v1/kv_offload/cpu/gpu_worker.py:600-634``). Each group
    copies whole pages of the tensors its layers reference (once per tensor; vLLM copies
    once per layer reference, un-padded — the same bytes); ``transfer_size`` is counted as
    vLLM counts it (per reference, un-padded page).

    ``host_view(bytes_per_chunk)``, when given, supplies each tensor's host tensor (rows
    may be strided: the tiering spec's shared region, one row per chunk holding every
    tensor); without it each tensor gets a private zeroed one.

    A submit copies at once and returns ``True``; ``get_finished`` hands back the results
    since the last call; ``wait`` has nothing to wait for. The connector submits a step's
    stores at the start of the next step, after the forward pass that wrote those blocks,
    and the loads before the forward pass that reads them
    (``distributed/kv_transfer/kv_connector/v1/offloading/worker.py:246-271``), so
    synchronous copies see the right bytes.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 num_chunks: int, host_view: Callable[[int], Any] | None = None) -> None:
        if blocks_per_chunk < 1 or num_chunks < 0:
            raise ValueError(f"blocks_per_chunk={blocks_per_chunk}, num_chunks={num_chunks}")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        self.engine: list[Any] = []  # (num_blocks, page) int8 views of the KV tensors
        self.host: list[Any] = []  # (num_chunks, page * blocks_per_chunk) int8
        self._host_sub: list[Any] = []  # the same, as (num_chunks, bpc, page)
        for t in kv_caches.tensors:
            page = int(t.page_size_bytes)
            engine = t.tensor.view(torch.int8).view(-1, page)
            if engine.device.type != "cpu":
                raise ValueError(f"KV cache tensor on {engine.device}: the host copy worker "
                                 "is for KV caches in host memory (vLLM's CPU build)")
            if host_view is None:
                host = torch.zeros((num_chunks, page * blocks_per_chunk), dtype=torch.int8)
            else:
                host = host_view(page * blocks_per_chunk)
                if tuple(host.shape) != (num_chunks, page * blocks_per_chunk) \
                        or host.stride(1) != 1:
                    raise ValueError(f"host view of shape {tuple(host.shape)}, strides "
                                     f"{host.stride()}: wanted ({num_chunks}, "
                                     f"{page * blocks_per_chunk}) with unit column stride")
            self.engine.append(engine)
            self.host.append(host)
            self._host_sub.append(torch.as_strided(
                host, (num_chunks, blocks_per_chunk, page), (host.stride(0), page, 1),
                host.storage_offset()))
        self._group_tensors = [sorted({r.tensor_idx for r in refs})
                               for refs in kv_caches.group_data_refs]
        self._group_refs = [[int(r.tensor_idx) for r in refs]
                            for refs in kv_caches.group_data_refs]
        self._group_bytes = [sum(int(r.page_size_bytes) for r in refs)
                             for refs in kv_caches.group_data_refs]
        self._done: list[TransferResult] = []

    def _engine_blocks(self, engine: Any) -> tuple[Any, list[int], list[int]]:
        """The engine side of a transfer as (block ids, group sizes, first block index per
        group), from what vLLM hands in: a ``GPULoadStoreSpec`` (0.32, 0.33: block ids) or
        a ``DevicePointers`` (0.34: one address per block and data reference, resolved from
        the KV caches registered with ``get_worker``, ``v1/kv_offload/pointer_utils.py``).
        Addresses are turned back into block ids of the engine's tensors; one that is not
        a block of the tensor its data reference names is refused before any byte moves."""
        # vllm-release: 0.34
        if hasattr(engine, "ptrs"):
            return self._pointer_blocks(engine)
        # vllm-release: 0.32, 0.33
        return (np.asarray(engine.block_ids, dtype=np.int64), list(engine.group_sizes),
                list(engine.block_indices))

    # vllm-release: 0.34
    def _pointer_blocks(self, engine: Any) -> tuple[Any, list[int], list[int]]:
        """:meth:`_engine_blocks` of a ``DevicePointers`` (vLLM 0.34)."""
        ptrs = np.asarray(engine.ptrs, dtype=np.uint64)
        sizes = [int(n) for n in engine.group_block_counts]
        refs = [int(n) for n in engine.group_data_ref_counts]
        if len(sizes) != len(self._group_refs) or len(refs) != len(sizes):
            raise ValueError(f"device pointers for {len(sizes)} groups, {len(refs)} data "
                             f"reference counts: the engine has {len(self._group_refs)}")
        ids: list[Any] = []
        off = 0
        for g, (size, n_refs) in enumerate(zip(sizes, refs, strict=True)):
            if size == 0:
                continue
            if n_refs != len(self._group_refs[g]) or off + size * n_refs > len(ptrs):
                raise ValueError(f"group {g}: {n_refs} data references of {size} blocks "
                                 f"from {len(ptrs) - off} pointers (the engine's group has "
                                 f"{len(self._group_refs[g])} references)")
            group: Any = None
            for d, t in enumerate(self._group_refs[g]):
                tensor = self.engine[t]
                base, row = int(tensor.data_ptr()), int(tensor.stride(0))
                at = ptrs[off + d * size:off + (d + 1) * size].astype(np.int64) - base
                got = at // row
                if (at % row).any() or (got < 0).any() or (got >= tensor.shape[0]).any():
                    raise ValueError(f"group {g}: a device pointer is not a block of KV "
                                     f"tensor {t}")
                if group is not None and not np.array_equal(group, got):
                    raise ValueError(f"group {g}: its data references point at different "
                                     "blocks")
                group = got
            ids.append(group)
            off += size * n_refs
        if off != len(ptrs):
            raise ValueError(f"{len(ptrs)} device pointers for {off} block copies")
        block_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
        return block_ids, sizes, [int(i) for i in engine.block_indices]

    def _plan(self, engine: Any, host_spec: BlockIDsLoadStoreSpec
              ) -> list[tuple[int, Any, Any]]:
        """Per group: (group, engine block ids, host sub-block ids), checked before any
        byte is copied."""
        bpc = self.blocks_per_chunk
        engine_ids, group_sizes, block_indices = self._engine_blocks(engine)
        host_ids = np.asarray(host_spec.block_ids, dtype=np.int64)
        plan: list[tuple[int, Any, Any]] = []
        off_e = off_h = 0
        for g, (size, first) in enumerate(zip(group_sizes, block_indices, strict=True)):
            if size == 0:
                continue
            skip = int(first) % bpc
            n_chunks = -(-(size + skip) // bpc)
            if off_e + size > len(engine_ids) or off_h + n_chunks > len(host_ids):
                break
            pos = np.arange(skip, skip + size)
            plan.append((g, engine_ids[off_e:off_e + size],
                         host_ids[off_h + pos // bpc] * bpc + pos % bpc))
            off_e += size
            off_h += n_chunks
        else:
            if off_e == len(engine_ids) and off_h == len(host_ids):
                return plan
        raise ValueError(f"a transfer of {len(engine_ids)} blocks to {len(host_ids)} chunks "
                         f"does not match its group sizes {group_sizes} and first blocks "
                         f"{block_indices}")

    def _transfer(self, job_id: int, engine: Any, host_spec: LoadStoreSpec,
                  store: bool) -> bool:
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"not a host chunk spec: {type(host_spec).__name__}")
        start = time.perf_counter()
        nbytes = 0
        bpc = self.blocks_per_chunk
        for g, engine_ids, host_ids in self._plan(engine, host_spec):
            e_idx = torch.from_numpy(engine_ids)
            at = (torch.from_numpy(host_ids // bpc), torch.from_numpy(host_ids % bpc))
            for t in self._group_tensors[g]:
                engine_t, host = self.engine[t], self._host_sub[t]
                if store:
                    host[at] = engine_t.index_select(0, e_idx)
                else:
                    engine_t.index_copy_(0, e_idx, host[at])
            nbytes += len(engine_ids) * self._group_bytes[g]
        self._done.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                         transfer_time=time.perf_counter() - start))
        return True

    # The engine side is positional only: vLLM's connector passes it by position, and its
    # name and type changed in 0.34 (``src_spec``/``dst_spec``, a ``GPULoadStoreSpec``,
    # became ``device_ptrs``, a ``DevicePointers``); ``_engine_blocks`` reads either.
    def submit_store(self, job_id: int, engine: Any, dst_spec: LoadStoreSpec, /) -> bool:
        return self._transfer(job_id, engine, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, engine: Any, /,
                    expedited: bool = False) -> bool:
        # vLLM 0.33 and later may ask for an expedited load (one waited on within the
        # step); every copy here is done when its submit returns: nothing to expedite.
        del expedited
        return self._transfer(job_id, engine, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when its submit returns


class MoriHostOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``CPUOffloadingSpec`` (``v1/kv_offload/cpu/spec.py:43-207``) with
    :class:`HostCopyOffloadingWorker` as its worker.

    Everything else is vLLM's: the tier's size (``num_chunks``, from ``cpu_bytes_to_use``:
    ``v1/kv_offload/cpu/spec.py:93-126``), the manager and its cache policy
    (``eviction_policy``, ``cache_policy_module_path``: ``v1/kv_offload/cpu/spec.py:134-159``)
    and the metrics. Loaded with ``spec_name`` / ``spec_module_path``
    (``v1/kv_offload/factory.py:30-58``); the connector's worker side calls ``get_worker``
    once, with the engine's KV caches
    (``distributed/kv_transfer/kv_connector/v1/offloading/worker.py:68-69``).
    """

    _host_worker: HostCopyOffloadingWorker | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_worker_hooks()
        super().__init__(*args, **kwargs)

    @property
    def cpu_tier_tokens(self) -> int:
        """Tokens the tier holds (of the first KV cache group: for a model with one
        group, the tier's size in tokens)."""
        return tier_tokens(self)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyOffloadingWorker:
        if self._host_worker is None:
            self._host_worker = HostCopyOffloadingWorker(
                kv_caches, int(self.blocks_per_chunk), int(self.num_chunks))
        return self._host_worker


def check_worker_hooks() -> None:
    """Refuse (one line) a vLLM whose ``OffloadingWorker`` the copy worker does not fit."""
    compat.check(vllm.__version__, compat.hook_problems(
        OffloadingWorker, HostCopyOffloadingWorker, OffloadingWorker.__abstractmethods__))


def tier_tokens(spec: CPUOffloadingSpec) -> int:
    """Tokens a host tier of ``spec`` holds (of the first KV cache group)."""
    if not spec.tokens_per_block:
        return 0
    return int(spec.num_chunks * spec.blocks_per_chunk * spec.tokens_per_block[0])


class MoriTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``TieringOffloadingSpec`` (``v1/kv_offload/tiering/spec.py``: a CPU primary
    tier and secondary tiers behind it, MORI's disk tier among them) with
    :class:`HostCopyOffloadingWorker` as its worker, for the CPU build.

    vLLM's tiering spec keeps the primary tier in a ``SharedOffloadRegion`` (an mmap of
    ``/dev/shm``) that the scheduler process maps too: secondary tiers read and write
    chunks there (``primary_kv_view``), in the scheduler's process. Its worker is vLLM's
    CUDA copy worker, refused on the CPU platform; this spec maps the same region in the
    worker (as vLLM's ``create_worker`` does) and copies between it and the engine's KV
    caches with the plain copy worker, one strided view per KV tensor
    (``SharedOffloadRegion.create_next_worker_view``). Everything else is vLLM's.

    The region's file in ``/dev/shm`` is unlinked once both sides have mapped it (the
    worker maps it first, when the engine registers its KV caches; the scheduler joins
    when it builds the manager), so that the kernel frees the tier's memory when the
    engine's processes exit, killed or not. vLLM's own tiering spec keeps the file until
    its creator cleans up, which a killed engine never does.
    """

    _host_worker: HostCopyOffloadingWorker | None = None
    _worker_region: SharedOffloadRegion | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_worker_hooks()
        super().__init__(*args, **kwargs)

    @property
    def cpu_tier_tokens(self) -> int:
        return tier_tokens(self)

    def get_manager(self) -> Any:
        manager = super().get_manager()
        region = getattr(self, "_scheduler_mmap", None)
        # joined (not created) by the scheduler: the worker has mapped it already
        if region is not None and not getattr(region, "_creator", True) \
                and int(self.config.parallel.world_size) == 1:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(region.mmap_path)
        return manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> HostCopyOffloadingWorker:
        if self._host_worker is None:
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id, num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._host_worker = HostCopyOffloadingWorker(
                    kv_caches, int(self.blocks_per_chunk), int(self.num_chunks),
                    host_view=region.create_next_worker_view)
            except Exception:
                region.cleanup()
                raise
            self._worker_region = region
        return self._host_worker
