"""Model and GPU specifications, and the hardware presets of the paper's experiments
(plus ``cpu-tiny-llama``, the CPU engine of the real-engine benchmark).

Pure data: frozen dataclasses whose derived figures are properties. The numbers come
from the public model configs and GPU datasheets listed in docs/costmodel.md; the
efficiencies (eta) are starting estimates, to be refitted from measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mori.core.registry import Registry

__all__ = [
    "B200",
    "CPU_VLLM",
    "DISKS",
    "CPU_VLLM_POOL_TOKENS",
    "H100_SXM",
    "H200",
    "H200_80G",
    "LLAMA_3_1_70B",
    "PRESETS",
    "QWEN2_5_7B",
    "QWEN3_30B_A3B",
    "TINY_LLAMA",
    "DiskSpec",
    "GPUSpec",
    "HardwarePreset",
    "ModelSpec",
    "allreduce_estimate_s",
    "get_disk",
    "get_preset",
]

_MiB = 1 << 20
_GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A transformer's shape, as far as the cost model needs it.

    ``params_active`` is the parameters one token runs through (== ``params_total`` for
    a dense model). For a mixture-of-experts model ``expert_params`` is the sum of all
    experts' weights over all layers, of which each token uses ``experts_per_token`` of
    ``num_experts``. ``embedding_params`` counts the input embedding and the (untied)
    output head: they are not GEMMs a prefill token pays for (the embedding is a
    lookup; the head runs on the last token of a chunk only), so they are left out of
    the linear FLOPs, which is how docs/costmodel.md's figures (13.1 G / 5.5 G / 136.9 G)
    come out of the configs.
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params_total: int
    params_active: int
    embedding_params: int = 0
    expert_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    context_window: int = 131_072
    bytes_per_param: int = 2  # bf16 weights and KV

    def __post_init__(self) -> None:
        for field_name in ("layers", "q_heads", "kv_heads", "head_dim", "params_total"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{self.name}: {field_name} must be positive")
        if not 0 < self.params_active <= self.params_total:
            raise ValueError(f"{self.name}: params_active must be in (0, params_total]")
        if not 0 <= self.embedding_params < self.params_active:
            raise ValueError(f"{self.name}: embedding_params must be in [0, params_active)")
        if not 0 <= self.expert_params < self.params_total:
            raise ValueError(f"{self.name}: expert_params must be in [0, params_total)")
        if self.expert_params == 0:
            if self.num_experts or self.experts_per_token:
                raise ValueError(f"{self.name}: a dense model has no experts")
            if self.params_active != self.params_total:
                raise ValueError(f"{self.name}: a dense model has params_active == total")
        else:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(f"{self.name}: need 0 < experts_per_token <= num_experts")
            # Experts of equal size: active = non-expert + the top-k experts' share.
            expected = self.non_expert_params + self.expert_params * self.expert_fraction
            if abs(self.params_active - expected) > 0.01 * expected:
                raise ValueError(f"{self.name}: params_active inconsistent with experts")
        if self.context_window <= 0 or self.bytes_per_param <= 0:
            raise ValueError(f"{self.name}: context_window and bytes_per_param must be > 0")

    @property
    def is_moe(self) -> bool:
        return self.expert_params > 0

    @property
    def expert_fraction(self) -> float:
        """k / E: the share of the experts one token runs through (0 for dense)."""
        return self.experts_per_token / self.num_experts if self.is_moe else 0.0

    @property
    def non_expert_params(self) -> int:
        return self.params_total - self.expert_params

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer: 2 x L x kv_heads x head_dim x bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> int:
        return self.params_total * self.bytes_per_param

    @property
    def linear_flops_per_token(self) -> int:
        """GEMM FLOPs per token: 2 x active params, embeddings excluded."""
        return 2 * (self.params_active - self.embedding_params)

    @property
    def attn_flops_per_token_per_ctx(self) -> int:
        """Attention FLOPs per (new token, attended context token): 4 x L x hq x dh."""
        return 4 * self.layers * self.q_heads * self.head_dim

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one forward pass over ``tokens`` tokens reads from HBM.

        Dense: all weights. MoE: the non-expert weights plus the experts the batch
        touches, 1 - (1 - k/E)^B of them under uniform routing (an estimate; real
        routing is skewed and touches fewer).
        """
        if not self.is_moe:
            return float(self.weight_bytes)
        touched = 1.0 - (1.0 - self.expert_fraction) ** max(tokens, 0)
        return float(self.non_expert_params * self.bytes_per_param) + (
            self.expert_params * self.bytes_per_param * touched
        )


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One accelerator: memory, bandwidths (bytes/s) and dense bf16 FLOP/s."""

    name: str
    hbm_bytes: int
    mem_bw: float
    flops: float
    # KV reloads host to GPU (the PCIe link; `--reload-gbps` sets it in GB/s): per
    # direction, pinned host memory (45-55 GB/s in practice)
    reload_bw: float = 50e9

    def __post_init__(self) -> None:
        if self.hbm_bytes <= 0 or self.mem_bw <= 0 or self.flops <= 0 or self.reload_bw <= 0:
            raise ValueError(f"{self.name}: memory, bandwidths and FLOP/s must be positive")


def allreduce_estimate_s(layers: int, tp: int) -> float:
    """A per-iteration all-reduce estimate: two small all-reduces per layer at ~10 us.

    Latency-bound (decode-sized messages over NVLink); large prefill chunks would add
    a bandwidth term, which we leave to calibration.
    """
    return 0.0 if tp <= 1 else 2 * layers * 10e-6


@dataclass(frozen=True, slots=True)
class HardwarePreset:
    """A replica configuration: GPU, model, tensor parallelism and engine constants.

    The KV pool follows SGLang: ``mem_fraction_static`` of HBM, less the weight shard,
    less an optional activation reserve, in whole pages of ``page_tokens``.
    """

    name: str
    gpu: GPUSpec
    model: ModelSpec
    mem_fraction_static: float
    chunk_size: int
    tp: int = 1
    page_tokens: int = 64
    eta_mem: float = 0.8
    eta_gemm: float = 0.65
    eta_attn: float = 0.5
    tau: float = 0.002  # fixed per-iteration overhead, seconds
    allreduce_s: float = 0.0  # per iteration when tp > 1, seconds
    activation_reserve_bytes: int = 0
    # fixed time each request costs beyond its tokens' compute (the API server's HTTP,
    # tokenization and output path), seconds, charged to the engine: on the CPU build
    # they share the engine's CPU (0: not modelled, as for the GPU presets)
    request_overhead_s: float = 0.0
    # the host tier's copy runs on the engine's own processor (the CPU build: no link
    # beside the compute), so a reload takes the engine's time instead of overlapping it
    reload_on_engine: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"{self.name}: tp must be >= 1")
        if self.tp == 1 and self.allreduce_s != 0.0:
            raise ValueError(f"{self.name}: allreduce_s must be 0 when tp == 1")
        for field_name in ("mem_fraction_static", "eta_mem", "eta_gemm", "eta_attn"):
            value = getattr(self, field_name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{self.name}: {field_name} must be in (0, 1]")
        if self.chunk_size <= 0 or self.page_tokens <= 0:
            raise ValueError(f"{self.name}: chunk_size and page_tokens must be positive")
        if (self.tau < 0 or self.allreduce_s < 0 or self.activation_reserve_bytes < 0
                or not 0.0 <= self.request_overhead_s < math.inf):
            raise ValueError(
                f"{self.name}: tau, allreduce_s, reserve and request_overhead_s must be >= 0")
        if self.gpu_kv_capacity_tokens <= 0:
            raise ValueError(f"{self.name}: the model leaves no room for a KV pool")

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """KV bytes per token on one GPU: the KV heads are split over the TP ranks
        (and replicated when tp > kv_heads, as SGLang does)."""
        m = self.model
        heads = math.ceil(m.kv_heads / self.tp)
        return 2 * m.layers * heads * m.head_dim * m.bytes_per_param

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model.weight_bytes / self.tp

    @property
    def gpu_kv_capacity_tokens(self) -> int:
        """Tokens the GPU KV pool holds, rounded down to whole pages."""
        free = (
            self.mem_fraction_static * self.gpu.hbm_bytes
            - self.weight_bytes_per_gpu
            - self.activation_reserve_bytes
        )
        tokens = max(0, math.floor(free / self.kv_bytes_per_token_per_gpu))
        return tokens // self.page_tokens * self.page_tokens

    @property
    def gpu_kv_capacity_bytes(self) -> int:
        """Bytes of the KV pool on one GPU."""
        return self.gpu_kv_capacity_tokens * self.kv_bytes_per_token_per_gpu


# --- Models (public configs; bf16) -------------------------------------------------

QWEN2_5_7B = ModelSpec(
    name="Qwen2.5-7B",
    layers=28,
    q_heads=28,
    kv_heads=4,
    head_dim=128,
    params_total=7_615_616_512,
    params_active=7_615_616_512,
    embedding_params=2 * 152_064 * 3_584,  # untied embedding + lm_head
)

QWEN3_30B_A3B = ModelSpec(
    name="Qwen3-30B-A3B",
    layers=48,
    q_heads=32,
    kv_heads=4,
    head_dim=128,
    params_total=30_532_122_624,
    # non-expert 1,541,093,376 + 8/128 of the experts
    params_active=3_353_032_704,
    embedding_params=2 * 151_936 * 2_048,
    expert_params=48 * 128 * 3 * 2_048 * 768,  # layers x experts x (gate, up, down) ~ 29.0 B
    num_experts=128,
    experts_per_token=8,
)

LLAMA_3_1_70B = ModelSpec(
    name="Llama-3.1-70B",
    layers=80,
    q_heads=64,
    kv_heads=8,
    head_dim=128,
    params_total=70_553_706_496,
    params_active=70_553_706_496,
    embedding_params=2 * 128_256 * 8_192,
)

# A random-weight 2-layer Llama (scripts/make_tiny_model.py) that vLLM's CPU build serves
# in the real-engine benchmark: hidden 128, 2 query heads and 1 KV head of 64, MLP 256,
# vocabulary 552, untied head, bf16.
_TINY_HIDDEN, _TINY_HEADS, _TINY_KV_HEADS, _TINY_HEAD_DIM = 128, 2, 1, 64
_TINY_MLP, _TINY_VOCAB, _TINY_LAYERS = 256, 552, 2
_TINY_LAYER_PARAMS = (
    _TINY_HIDDEN * _TINY_HEADS * _TINY_HEAD_DIM * 2  # q and o projections
    + _TINY_HIDDEN * _TINY_KV_HEADS * _TINY_HEAD_DIM * 2  # k and v projections
    + _TINY_HIDDEN * _TINY_MLP * 3  # MLP gate, up and down
    + _TINY_HIDDEN * 2  # the two RMS norms
)
_TINY_EMBEDDINGS = 2 * _TINY_VOCAB * _TINY_HIDDEN  # input embedding + untied lm_head
_TINY_PARAMS = _TINY_EMBEDDINGS + _TINY_LAYERS * _TINY_LAYER_PARAMS + _TINY_HIDDEN  # final norm

TINY_LLAMA = ModelSpec(
    name="tiny-llama (random, 2 layers)",
    layers=_TINY_LAYERS,
    q_heads=_TINY_HEADS,
    kv_heads=_TINY_KV_HEADS,
    head_dim=_TINY_HEAD_DIM,
    params_total=_TINY_PARAMS,  # 436,864
    params_active=_TINY_PARAMS,
    embedding_params=_TINY_EMBEDDINGS,
    # the engine's max_model_len with 128 blocks of 32 tokens: (128 - 1) x 32
    context_window=4_064,
)

# --- GPUs (datasheets; memory as the driver reports it) ----------------------------

H100_SXM = GPUSpec("H100-SXM", hbm_bytes=81_559 * _MiB, mem_bw=3.35e12, flops=989e12)
H200 = GPUSpec("H200", hbm_bytes=143_771 * _MiB, mem_bw=4.8e12, flops=989e12)
# The paper's "H200 capped to 80 GB": same chip, 80 GB usable.
H200_80G = GPUSpec("H200-80GB", hbm_bytes=80 * 10**9, mem_bw=4.8e12, flops=989e12)
B200 = GPUSpec("B200", hbm_bytes=178 * _GiB, mem_bw=8.0e12, flops=2_250e12)

# vLLM's CPU build as the "GPU" of the tiny model. Its KV pool is set by block count
# (``--num-gpu-blocks-override 128``, one block kept aside), not by memory, so the memory
# here is whatever makes the preset's pool come out at 127 blocks x 32 = 4,064 tokens
# with ``mem_fraction_static=1``: the weights plus exactly that much KV. The speed
# figures are effective ones, fitted to the engine's measured step times (see
# ``_CPU_VLLM_*`` below); they are not a datasheet's.
CPU_VLLM_POOL_TOKENS = 127 * 32
"""The KV pool of the benchmark's vLLM CPU engine: 128 blocks of 32 tokens, less one."""

# Calibrated 2026-12-05 with bench/calibrate_cpu_engine.py --reps 5 --reload (vLLM 0.32.0
# CPU build on a 2-core machine, the engine on one CPU of its own as the real-engine
# benchmark runs it; medians of 5 requests): prefill of 63 / 513 / 1,023 / 2,048 / 3,500
# fresh tokens took 10.1 / 14.0 / 22.9 / 49.6 / 117.9 ms over HTTP (the model gives 10.2 /
# 14.2 / 22.3 / 50.0 / 117.8), one decode step of one request 2.46 ms. tau is the decode
# step less its weight read; the linear and attention rates and the request overhead (the
# fixed time every request costs beyond its tokens' compute) are fitted to the
# prefill times (the linear rate sets the effective FLOP/s, eta_gemm = 1); the memory
# figures are nominal (the tiny model's reads take microseconds). The day before: 14.0 /
# 20.5 / 29.7 / 58.7 / 131.7 ms and 2.52 ms; the first calibration (2026-12-01, on a busier
# machine) measured up to 5x slower: the same engine runs slower when the machine is
# shared, so a real-engine run should be compared with a calibration of the same day. A
# prompt of 512 / 1,024 / 2,048 / 3,500 tokens served from the host tier took 12.0 / 13.7 /
# 15.9 / 20.9 ms (the model: 11.5 / 13.1 / 16.3 / 20.9), whence the copy rate below: an
# effective one, the engine's load path, not the memory's bandwidth.
_CPU_VLLM_TAU = 0.002408  # seconds per engine iteration (scheduling, sampling, output)
_CPU_VLLM_FLOPS = 1.257e11  # effective FLOP/s of the linear layers
_CPU_VLLM_MEM_BW = 2.0e10  # bytes/s, nominal
_CPU_VLLM_ETA_GEMM = 1.0
_CPU_VLLM_ETA_ATTN = 0.56  # the attention kernels run at 56% of the linear layers' rate
_CPU_VLLM_ETA_MEM = 1.0
_CPU_VLLM_REQUEST_OVERHEAD_S = 0.00746  # HTTP, tokenization, output path, per request
_CPU_VLLM_COPY_BW = 1.634e8  # bytes/s from the host tier, fitted to the reload timings

CPU_VLLM = GPUSpec(
    "CPU (vLLM CPU build)",
    hbm_bytes=TINY_LLAMA.weight_bytes
    + CPU_VLLM_POOL_TOKENS * TINY_LLAMA.kv_bytes_per_token,
    mem_bw=_CPU_VLLM_MEM_BW,
    flops=_CPU_VLLM_FLOPS,
    reload_bw=_CPU_VLLM_COPY_BW,
)

# --- Presets -----------------------------------------------------------------------
# mem_fraction_static was chosen per preset to reproduce the KV pool sizes SGLang 0.5.10
# was observed to allocate with its defaults (~0.99 M, ~0.77 M and ~0.57 M tokens; see
# docs/costmodel.md). The fraction already leaves room for activations and CUDA graphs, so
# the activation reserve is 0.


def _build_presets() -> Registry[HardwarePreset]:
    registry: Registry[HardwarePreset] = Registry("hardware preset")
    presets = (
        HardwarePreset(
            name="h200-80g-qwen2.5-7b",
            gpu=H200_80G,
            model=QWEN2_5_7B,
            mem_fraction_static=0.900,  # -> 989,952 tokens
            chunk_size=8_192,
        ),
        HardwarePreset(
            name="h200-qwen3-30b-a3b",
            gpu=H200,
            model=QWEN3_30B_A3B,
            mem_fraction_static=0.907,  # -> 769,728 tokens
            chunk_size=8_192,
            eta_gemm=0.35,  # MoE grouped GEMMs run far below dense MFU
        ),
        HardwarePreset(
            name="b200-llama3.1-70b-tp2",
            gpu=B200,
            model=LLAMA_3_1_70B,
            tp=2,
            mem_fraction_static=0.858,  # -> 570,240 tokens
            chunk_size=16_384,
            allreduce_s=allreduce_estimate_s(LLAMA_3_1_70B.layers, 2),  # 1.6 ms
        ),
        # The tiny model on vLLM's CPU build, as bench/bench_vllm_agents.py runs it:
        # blocks of 32 tokens, 2,048-token prefill chunks (vLLM's CPU default
        # max_num_batched_tokens for the API server).
        HardwarePreset(
            name="cpu-tiny-llama",
            gpu=CPU_VLLM,
            model=TINY_LLAMA,
            mem_fraction_static=1.0,  # -> 4,064 tokens (see CPU_VLLM)
            chunk_size=2_048,
            page_tokens=32,
            eta_mem=_CPU_VLLM_ETA_MEM,
            eta_gemm=_CPU_VLLM_ETA_GEMM,
            eta_attn=_CPU_VLLM_ETA_ATTN,
            tau=_CPU_VLLM_TAU,
            request_overhead_s=_CPU_VLLM_REQUEST_OVERHEAD_S,
            reload_on_engine=True,
        ),
    )
    for preset in presets:
        registry.register(preset.name, preset)
    registry.freeze()
    return registry


PRESETS: Registry[HardwarePreset] = _build_presets()
"""The paper's configurations and the CPU engine of the real-engine benchmark
(``cpu-tiny-llama``), by name; built once at import and frozen."""


def get_preset(name: str) -> HardwarePreset:
    """The preset called ``name``; ``UnknownNameError`` lists the valid names."""
    return PRESETS.get(name)


# --- Disk tiers (NVMe under the host tier) -----------------------------------------
@dataclass(frozen=True, slots=True)
class DiskSpec:
    """A replica's local NVMe, as a third KV tier under the host (CPU) tier.

    ``read_bw`` and ``write_bw`` are sequential bytes/s (KV chunks are written and read
    whole, megabytes at a time); ``latency_s`` a typical read's latency at queue depth
    1, paid once per reload. Figures from the drive's data sheet as a review measured
    it (docs/costmodel.md, "The disk tier").
    """

    name: str
    capacity_bytes: int
    read_bw: float
    write_bw: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.read_bw <= 0 or self.write_bw <= 0:
            raise ValueError(f"{self.name}: capacity and bandwidths must be positive")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"{self.name}: latency_s must be a finite number >= 0")


# Micron 9550 MAX 12.8 TB (PCIe Gen5 x4, NVMe 2.0): 14,000 MB/s sequential read,
# 10,000 MB/s sequential write, 60 us typical read latency (Micron's specifications
# as StorageReview's review of the drive lists them, 2025).
NVME_GEN5 = DiskSpec("nvme-gen5", capacity_bytes=12_800 * 10**9, read_bw=14.0e9,
                     write_bw=10.0e9, latency_s=60e-6)
# Four of them striped (RAID-0): four times the capacity and, at best, the bandwidth
# (an upper bound: software RAID and the host's PCIe lanes take some of it); striping
# does not shorten a read's latency.
NVME_GEN5_RAID0X4 = DiskSpec("nvme-gen5-raid0x4", capacity_bytes=4 * 12_800 * 10**9,
                             read_bw=4 * 14.0e9, write_bw=4 * 10.0e9, latency_s=60e-6)


def _build_disks() -> Registry[DiskSpec]:
    registry: Registry[DiskSpec] = Registry("disk")
    for disk in (NVME_GEN5, NVME_GEN5_RAID0X4):
        registry.register(disk.name, disk)
    registry.freeze()
    return registry


DISKS: Registry[DiskSpec] = _build_disks()
"""The disk tiers the simulator models, by name (one drive, and four striped)."""


def get_disk(name: str) -> DiskSpec:
    """The disk called ``name``; ``UnknownNameError`` lists the valid names."""
    return DISKS.get(name)
