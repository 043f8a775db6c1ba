"""The roofline cost model: seconds per engine iteration, decode runs and KV reloads.

Pure and deterministic: no I/O, no clock. One iteration of a continuous-batching engine
prefills a chunk of new tokens and decodes one token for each running request. Per GPU,
with tensor-parallel degree t (docs/costmodel.md):

    tau + max(linear FLOPs / (t eta_gemm FLOPS), (weights read + KV read) / (t eta_mem BW))
        + prefill attention FLOPs / (t eta_attn FLOPS) + all-reduce (t > 1)

The linear layers of all tokens share one weight read, hence the max (roofline). Decode
attention is a KV read, so it sits in the memory term; prefill attention is compute.
Every duration is multiplied by the model's ``engine_slowdown`` (1 by default): an engine
whose clock runs that many times slower than the workload's, as when a trace is replayed
with ``mori replay --time-scale T`` against a real engine.
The specs and presets live in ``mori.core.hardware`` and are re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mori.core.hardware import (
    PRESETS,
    DiskSpec,
    GPUSpec,
    HardwarePreset,
    ModelSpec,
    get_preset,
)

__all__ = [
    "PRESETS",
    "CostModel",
    "GPUSpec",
    "HardwarePreset",
    "ModelSpec",
    "get_preset",
    "prefill_attn_ctx",
]


def prefill_attn_ctx(new: int, cached: int) -> float:
    """Sum over a chunk's ``new`` tokens of the context each attends to.

    Each new token sees the ``cached`` prefix plus (on average) half the chunk:
    ``new * cached + new * new / 2``.
    """
    if new < 0 or cached < 0:
        raise ValueError("new and cached must be >= 0")
    return new * cached + new * new / 2


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step times for one replica described by a ``HardwarePreset``. Immutable.

    ``engine_slowdown``: every duration it gives (iterations, decode runs, reloads) is
    multiplied by this factor (> 0); the preset's figures are for 1.
    """

    preset: HardwarePreset
    engine_slowdown: float = 1.0
    # Per-unit times, precomputed once (seconds per token / per byte / per FLOP unit).
    _s_per_linear_token: float = field(init=False, repr=False, compare=False)
    _s_per_attn_unit: float = field(init=False, repr=False, compare=False)
    _s_per_hbm_byte: float = field(init=False, repr=False, compare=False)
    _kv_bytes_gpu: int = field(init=False, repr=False, compare=False)
    _overhead: float = field(init=False, repr=False, compare=False)
    _tau: float = field(init=False, repr=False, compare=False)
    _allreduce: float = field(init=False, repr=False, compare=False)
    # tokens -> weight bytes per GPU one pass reads (a pure function of the count;
    # the MoE estimate's power is the costly part, so it is computed once per count)
    _weights: dict[int, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.engine_slowdown) and self.engine_slowdown > 0):
            raise ValueError(f"engine_slowdown must be a finite number > 0 "
                             f"(got {self.engine_slowdown})")
        p, k = self.preset, self.engine_slowdown
        m, g, t = p.model, p.gpu, p.tp
        set_ = object.__setattr__
        set_(self, "_s_per_linear_token",
             m.linear_flops_per_token / (t * p.eta_gemm * g.flops) * k)
        set_(self, "_s_per_attn_unit",
             m.attn_flops_per_token_per_ctx / (t * p.eta_attn * g.flops) * k)
        # Bytes are per GPU already (weights / t, KV shard), so no further / t here.
        set_(self, "_s_per_hbm_byte", 1.0 / (p.eta_mem * g.mem_bw) * k)
        set_(self, "_kv_bytes_gpu", p.kv_bytes_per_token_per_gpu)
        set_(self, "_tau", p.tau * k)
        set_(self, "_allreduce", p.allreduce_s * k)
        set_(self, "_overhead", (p.tau + p.allreduce_s) * k)
        set_(self, "_weights", {})

    def _weight_bytes(self, tokens: int) -> float:
        """``weight_bytes_read(tokens) / tp``, memoized."""
        v = self._weights.get(tokens)
        if v is None:
            v = self.preset.model.weight_bytes_read(tokens) / self.preset.tp
            self._weights[tokens] = v
        return v

    @classmethod
    def from_preset_name(cls, name: str) -> CostModel:
        """A cost model for a registered preset (``UnknownNameError`` lists the names)."""
        return cls(get_preset(name))

    @property
    def gpu_kv_capacity_tokens(self) -> int:
        return self.preset.gpu_kv_capacity_tokens

    def iteration_time(
        self,
        prefill_new: int,
        prefill_attn_ctx: float,
        decode_batch: int,
        decode_ctx_sum: int,
    ) -> float:
        """Seconds for one iteration: prefill ``prefill_new`` tokens whose attended
        contexts sum to ``prefill_attn_ctx`` (see the module-level helper), and decode
        one token for each of ``decode_batch`` requests whose contexts sum to
        ``decode_ctx_sum``. No work costs 0.0 (no fixed overhead)."""
        if prefill_new < 0 or prefill_attn_ctx < 0 or decode_batch < 0 or decode_ctx_sum < 0:
            raise ValueError("iteration_time arguments must be >= 0")
        if prefill_new == 0 and prefill_attn_ctx > 0:
            raise ValueError("prefill_attn_ctx > 0 without prefill tokens")
        if decode_batch == 0 and decode_ctx_sum > 0:
            raise ValueError("decode_ctx_sum > 0 without decode requests")
        tokens = prefill_new + decode_batch
        if tokens == 0:
            return 0.0
        compute = tokens * self._s_per_linear_token
        memory = (
            self._weight_bytes(tokens)
            + self._kv_bytes_gpu * decode_ctx_sum
        ) * self._s_per_hbm_byte
        attention = prefill_attn_ctx * self._s_per_attn_unit
        return self._tau + max(compute, memory) + attention + self._allreduce

    def prefill_chunk_time(self, new: int, cached: int) -> float:
        """One iteration prefilling ``new`` tokens on top of ``cached`` ones, no decodes."""
        return self.iteration_time(new, prefill_attn_ctx(new, cached), 0, 0)

    def prefill_rate(self, context: int = 32_768) -> float:
        """Tokens a second of prefilling a ``context``-token context from nothing in the
        preset's chunks, alone (what a recompute of it costs)."""
        if context < 1:
            raise ValueError("context must be >= 1")
        return context / self.prefill_time(context)

    def prefill_time(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` tokens from nothing in the preset's chunks,
        alone (the request overhead not included)."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        chunk = self.preset.chunk_size
        total, done = 0.0, 0
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.prefill_chunk_time(n, done)
            done += n
        return total

    def decode_run_time(self, batch: int, ctx_sum0: int, n: int) -> float:
        """Seconds for ``n`` pure-decode iterations of a fixed batch, in O(1).

        Equals ``sum(iteration_time(0, 0, batch, ctx_sum0 + i * batch) for i in
        range(n))``: the compute term C is constant in i and the memory term a + s*i is
        affine, so the sum splits at the first index where memory reaches compute.
        """
        if batch < 0 or ctx_sum0 < 0 or n < 0:
            raise ValueError("decode_run_time arguments must be >= 0")
        if batch == 0 and ctx_sum0 > 0:
            raise ValueError("ctx_sum0 > 0 without decode requests")
        if batch == 0 or n == 0:
            return 0.0
        compute = batch * self._s_per_linear_token
        a = (
            self._weight_bytes(batch)
            + self._kv_bytes_gpu * ctx_sum0
        ) * self._s_per_hbm_byte
        s = self._kv_bytes_gpu * batch * self._s_per_hbm_byte  # > 0
        # k = number of leading iterations where compute dominates (a + s*i < C).
        k = 0 if a >= compute else min(n, math.ceil((compute - a) / s))
        m = n - k
        memory_sum = m * a + s * ((k + n - 1) * m / 2)
        return n * self._overhead + k * compute + memory_sum

    def decode_iters_within(self, batch: int, ctx_sum0: int, elapsed: float) -> int:
        """The largest n with ``decode_run_time(batch, ctx_sum0, n) <= elapsed``.

        The closed form is inverted (linear while compute dominates, then a quadratic)
        for an estimate, which is then checked against the closed form itself and moved
        by single steps (it is off by at most one but for rounding); if that takes more
        than a few steps, bisection over the closed form (strictly increasing in n)
        decides. Either way the answer is the one the closed form defines. Negative
        ``elapsed`` gives 0.
        """
        if batch <= 0:
            raise ValueError("batch must be > 0 (an empty batch decodes forever for free)")
        if not math.isfinite(elapsed):
            raise ValueError("elapsed must be finite")
        if elapsed <= 0:
            return 0
        run = self.decode_run_time
        n = self._decode_iters_estimate(batch, ctx_sum0, elapsed)
        for _ in range(4):
            if run(batch, ctx_sum0, n) > elapsed:
                n -= 1
            elif run(batch, ctx_sum0, n + 1) <= elapsed:
                n += 1
            else:
                return n
        return self._decode_iters_bisect(batch, ctx_sum0, elapsed)

    def _decode_iters_estimate(self, batch: int, ctx_sum0: int, elapsed: float) -> int:
        """``decode_iters_within`` from the inverted closed form, before the check."""
        over = self._overhead
        compute = batch * self._s_per_linear_token
        a = (self._weight_bytes(batch) + self._kv_bytes_gpu * ctx_sum0) * self._s_per_hbm_byte
        s = self._kv_bytes_gpu * batch * self._s_per_hbm_byte
        k = 0 if a >= compute else math.ceil((compute - a) / s)
        head = k * (over + compute)  # the compute-bound iterations
        if elapsed < head:
            return max(0, int(elapsed // (over + compute)))
        # then iteration i (from k) costs over + a + s*i: m of them cost
        # m*(over + a) + s*(2k - 1 + m)*m/2
        b = over + a + s * (2 * k - 1) / 2
        m = (math.sqrt(b * b + 2 * s * (elapsed - head)) - b) / s
        return k + max(0, int(m))

    def _decode_iters_bisect(self, batch: int, ctx_sum0: int, elapsed: float) -> int:
        first = self.decode_run_time(batch, ctx_sum0, 1)  # every later iteration is longer
        lo = 0
        hi = math.floor(elapsed / first) + 1
        while self.decode_run_time(batch, ctx_sum0, hi) <= elapsed:  # float safety
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # invariant: run_time(lo) <= elapsed < run_time(hi)
            mid = (lo + hi) // 2
            if self.decode_run_time(batch, ctx_sum0, mid) <= elapsed:
                lo = mid
            else:
                hi = mid
        return lo

    @property
    def request_overhead(self) -> float:
        """Seconds each request costs the engine beyond its tokens' compute (the
        preset's ``request_overhead_s``: HTTP, tokenization, the output path)."""
        return self.preset.request_overhead_s * self.engine_slowdown

    def reload_time(self, tokens: int) -> float:
        """Seconds to copy ``tokens`` tokens of KV from host to GPU over PCIe.

        Per GPU: each TP rank loads its own shard over its own link, in parallel.
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        return tokens * self._kv_bytes_gpu / self.preset.gpu.reload_bw * self.engine_slowdown

    def disk_read_time(self, tokens: int, disk: DiskSpec) -> float:
        """Seconds to bring ``tokens`` tokens of KV from ``disk`` to the GPU(s).

        Pipelined through host memory, as vLLM's offloading connector and LMCache read a
        file tier (chunk by chunk, each chunk copied to the GPU while the next is read):
        the slower of the disk (the replica's whole KV, every TP rank's shard, comes off
        one array) and each GPU's PCIe link, plus one read latency.
        """
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        if tokens == 0:
            return 0.0
        p = self.preset
        disk_s = tokens * p.kv_bytes_per_token_per_gpu * p.tp / disk.read_bw
        return (disk.latency_s + max(disk_s, self.reload_time(tokens) / self.engine_slowdown)) \
            * self.engine_slowdown

    def disk_write_time(self, tokens: int, disk: DiskSpec) -> float:
        """Seconds ``disk`` takes to write ``tokens`` tokens of the replica's KV (from
        host memory: the copy off the GPU is the host tier's)."""
        if tokens < 0:
            raise ValueError("tokens must be >= 0")
        p = self.preset
        return tokens * p.kv_bytes_per_token_per_gpu * p.tp / disk.write_bw * self.engine_slowdown
