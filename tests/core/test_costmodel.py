"""Tests for the roofline cost model, the hardware presets and the registry."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mori.core.costmodel import (
    PRESETS,
    CostModel,
    ModelSpec,
    get_preset,
    prefill_attn_ctx,
)
from mori.core.hardware import (
    LLAMA_3_1_70B,
    QWEN2_5_7B,
    QWEN3_30B_A3B,
    TINY_LLAMA,
    allreduce_estimate_s,
)
from mori.core.registry import (
    DuplicateNameError,
    FrozenRegistryError,
    Registry,
    UnknownNameError,
)

PRESET_NAMES = ["h200-80g-qwen2.5-7b", "h200-qwen3-30b-a3b", "b200-llama3.1-70b-tp2"]

# docs/costmodel.md: SGLang 0.5.10's observed KV pool sizes.
EXPECTED_CAPACITY = {
    "h200-80g-qwen2.5-7b": 0.99e6,
    "h200-qwen3-30b-a3b": 0.77e6,
    "b200-llama3.1-70b-tp2": 0.57e6,
}

# A compute-heavy variant, so that decode runs cross from compute- to memory-bound at
# many different indices.
_COMPUTE_HEAVY = dataclasses.replace(
    get_preset("h200-qwen3-30b-a3b"), name="test-compute-heavy", eta_gemm=0.05
)
ALL_MODELS = [CostModel(get_preset(n)) for n in PRESET_NAMES] + [CostModel(_COMPUTE_HEAVY)]
cost_models = st.sampled_from(ALL_MODELS)


def naive_decode_run(cm: CostModel, batch: int, ctx_sum0: int, n: int) -> float:
    return sum(cm.iteration_time(0, 0, batch, ctx_sum0 + i * batch) for i in range(n))


# --- presets and specs -----------------------------------------------------------


def test_preset_names_registered() -> None:
    assert PRESETS.names() == sorted([*PRESET_NAMES, "cpu-tiny-llama"])
    for name in PRESET_NAMES:
        assert name in PRESETS
        assert get_preset(name).name == name


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_capacity_matches_sglang_within_2_percent(name: str) -> None:
    preset = get_preset(name)
    capacity = preset.gpu_kv_capacity_tokens
    print(f"{name}: {capacity:,} tokens")
    assert capacity == pytest.approx(EXPECTED_CAPACITY[name], rel=0.02)
    assert capacity % preset.page_tokens == 0
    assert CostModel(preset).gpu_kv_capacity_tokens == capacity
    # The pool fits within the fraction of HBM left after the weight shard.
    used = preset.gpu_kv_capacity_bytes + preset.weight_bytes_per_gpu
    assert used <= preset.mem_fraction_static * preset.gpu.hbm_bytes


def test_kv_bytes_per_token_match_table() -> None:
    assert QWEN2_5_7B.kv_bytes_per_token == 57_344
    assert QWEN3_30B_A3B.kv_bytes_per_token == 98_304
    assert LLAMA_3_1_70B.kv_bytes_per_token == 327_680
    assert get_preset("b200-llama3.1-70b-tp2").kv_bytes_per_token_per_gpu == 163_840
    assert get_preset("h200-80g-qwen2.5-7b").kv_bytes_per_token_per_gpu == 57_344


def test_kv_heads_replicate_when_tp_exceeds_them() -> None:
    preset = dataclasses.replace(get_preset("b200-llama3.1-70b-tp2"), name="tp16", tp=16)
    # 8 KV heads over 16 ranks: one head per rank, not half a head.
    assert preset.kv_bytes_per_token_per_gpu == 2 * 80 * 1 * 128 * 2


@pytest.mark.parametrize(
    ("model", "weights_gb", "linear_g", "attn_m"),
    [
        (QWEN2_5_7B, 15.2, 13.1, 0.40),
        (QWEN3_30B_A3B, 61.1, 5.5, 0.79),
        (LLAMA_3_1_70B, 141.1, 136.9, 2.62),
    ],
)
def test_model_figures_match_table(
    model: ModelSpec, weights_gb: float, linear_g: float, attn_m: float
) -> None:
    assert model.weight_bytes / 1e9 == pytest.approx(weights_gb, abs=0.05)
    assert model.linear_flops_per_token / 1e9 == pytest.approx(linear_g, abs=0.05)
    assert model.attn_flops_per_token_per_ctx / 1e6 == pytest.approx(attn_m, abs=0.005)
    assert model.context_window == 131_072


def test_moe_split() -> None:
    m = QWEN3_30B_A3B
    assert m.is_moe and not QWEN2_5_7B.is_moe
    assert m.expert_params / 1e9 == pytest.approx(29.0, abs=0.05)
    assert m.params_active / 1e9 == pytest.approx(3.3, abs=0.1)
    # Weight bytes read grow with the batch, from about the active weights to all.
    reads = [m.weight_bytes_read(b) for b in (1, 8, 64, 512, 4096)]
    assert reads == sorted(reads)
    assert reads[0] == pytest.approx(m.params_active * 2, rel=1e-9)
    assert reads[-1] == pytest.approx(m.weight_bytes, rel=1e-6)
    assert QWEN2_5_7B.weight_bytes_read(1) == QWEN2_5_7B.weight_bytes


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(QWEN2_5_7B, params_active=QWEN2_5_7B.params_total - 1)
    with pytest.raises(ValueError):
        dataclasses.replace(QWEN3_30B_A3B, experts_per_token=0)
    with pytest.raises(ValueError):
        dataclasses.replace(get_preset("h200-80g-qwen2.5-7b"), allreduce_s=1e-3)
    with pytest.raises(ValueError):
        dataclasses.replace(get_preset("h200-80g-qwen2.5-7b"), eta_mem=0.0)
    with pytest.raises(ValueError):  # the weights alone exceed the memory fraction
        dataclasses.replace(get_preset("h200-80g-qwen2.5-7b"), mem_fraction_static=0.1)


def test_allreduce_only_with_tp() -> None:
    assert allreduce_estimate_s(80, 1) == 0.0
    assert get_preset("b200-llama3.1-70b-tp2").allreduce_s == pytest.approx(1.6e-3)


# --- registry --------------------------------------------------------------------


def test_unknown_preset_lists_valid_names() -> None:
    with pytest.raises(UnknownNameError) as info:
        get_preset("h100-nonexistent")
    message = str(info.value)
    assert "h100-nonexistent" in message
    assert ", ".join(PRESETS.names()) in message
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, ValueError)
    assert info.value.valid == sorted([*PRESET_NAMES, "cpu-tiny-llama"])


def test_registry_contract() -> None:
    reg: Registry[int] = Registry("widget")
    assert reg.register("b", 2) == 2
    reg.register("a", 1)
    assert reg.names() == ["a", "b"]
    assert list(reg) == ["a", "b"]
    assert len(reg) == 2
    assert "a" in reg and "c" not in reg
    assert reg.get("b") == 2
    with pytest.raises(DuplicateNameError):
        reg.register("a", 3)
    assert reg.get("a") == 1
    with pytest.raises(UnknownNameError, match=r"unknown widget 'c'; valid names: a, b"):
        reg.get("c")
    reg.freeze()
    with pytest.raises(FrozenRegistryError):
        reg.register("c", 3)


def test_preset_table_is_frozen() -> None:
    assert PRESETS.frozen
    with pytest.raises(FrozenRegistryError):
        PRESETS.register("x", get_preset("h200-80g-qwen2.5-7b"))


def test_cost_model_is_immutable() -> None:
    cm = CostModel(get_preset("h200-80g-qwen2.5-7b"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cm.preset = get_preset("h200-qwen3-30b-a3b")  # type: ignore[misc]
    assert CostModel.from_preset_name("h200-80g-qwen2.5-7b") == cm


# --- iteration time --------------------------------------------------------------


def test_prefill_attn_ctx() -> None:
    assert prefill_attn_ctx(0, 1000) == 0
    assert prefill_attn_ctx(4, 10) == 4 * 10 + 8
    with pytest.raises(ValueError):
        prefill_attn_ctx(-1, 0)


@pytest.mark.parametrize("cm", ALL_MODELS, ids=lambda cm: cm.preset.name)
def test_zero_work_is_free(cm: CostModel) -> None:
    assert cm.iteration_time(0, 0, 0, 0) == 0.0
    assert cm.decode_run_time(0, 0, 100) == 0.0
    assert cm.decode_run_time(8, 1000, 0) == 0.0
    assert cm.reload_time(0) == 0.0


def test_invalid_arguments() -> None:
    cm = CostModel(get_preset("h200-80g-qwen2.5-7b"))
    with pytest.raises(ValueError):
        cm.iteration_time(-1, 0, 0, 0)
    with pytest.raises(ValueError):
        cm.iteration_time(0, 0, 0, 10)  # context without requests
    with pytest.raises(ValueError):
        cm.iteration_time(0, 5.0, 1, 10)  # attention without prefill tokens
    with pytest.raises(ValueError):
        cm.decode_iters_within(0, 0, 1.0)
    with pytest.raises(ValueError):
        cm.reload_time(-1)


def test_sanity_moe_decode_step_tens_of_ms() -> None:
    cm = CostModel(get_preset("h200-qwen3-30b-a3b"))
    step = cm.iteration_time(0, 0, 32, 32 * 50_000)
    step_20k = cm.iteration_time(0, 0, 32, 32 * 20_000)
    print(
        f"Qwen3-30B-A3B on H200, decode 32 x 50k: {step * 1e3:.1f} ms; 32 x 20k: "
        f"{step_20k * 1e3:.1f} ms (paper: ~29-32 ms GPU step)"
    )
    assert 0.010 < step < 0.080
    assert 0.010 < step_20k < step


def test_sanity_dense_prefill_chunk() -> None:
    cm = CostModel(get_preset("h200-80g-qwen2.5-7b"))
    # Linear part alone: 8192 x 13.05 GFLOP / (0.65 x 989 TFLOP/s) ~ 0.166 s.
    linear_only = cm.iteration_time(8192, 0, 0, 0)
    expected_linear = 0.002 + 8192 * QWEN2_5_7B.linear_flops_per_token / (0.65 * 989e12)
    assert linear_only == pytest.approx(expected_linear, rel=1e-12)
    assert 0.160 < linear_only < 0.175
    # With causal attention over the chunk (8192^2 / 2 x 0.40 MFLOP at eta 0.5): +27 ms.
    chunk = cm.prefill_chunk_time(8192, 0)
    print(
        f"Qwen2.5-7B on H200, 8192-token prefill chunk: {chunk * 1e3:.1f} ms "
        f"(linear + tau {linear_only * 1e3:.1f} ms)"
    )
    assert 0.180 < chunk < 0.210


def test_reload_time_per_gpu_shard() -> None:
    cm = CostModel(get_preset("b200-llama3.1-70b-tp2"))
    assert cm.reload_time(1000) == pytest.approx(1000 * 163_840 / 50e9)
    # Reloading is far cheaper than recomputing the same prefix.
    assert cm.reload_time(16_384) * 10 < cm.prefill_chunk_time(16_384, 0)


@settings(max_examples=300, deadline=None)
@given(
    cm=cost_models,
    new=st.integers(0, 20_000),
    cached=st.integers(0, 200_000),
    batch=st.integers(0, 512),
    avg_ctx=st.integers(0, 100_000),
    which=st.sampled_from(["new", "cached", "batch", "ctx"]),
    extra=st.integers(1, 10_000),
)
def test_more_work_is_never_faster(
    cm: CostModel, new: int, cached: int, batch: int, avg_ctx: int, which: str, extra: int
) -> None:
    def t(new: int, cached: int, batch: int, ctx_sum: int) -> float:
        return cm.iteration_time(new, prefill_attn_ctx(new, cached), batch, ctx_sum)

    ctx_sum = batch * avg_ctx
    base = t(new, cached, batch, ctx_sum)
    if which == "new":
        more = t(new + extra, cached, batch, ctx_sum)
    elif which == "cached":
        more = t(new, cached + extra, batch, ctx_sum)
    elif which == "batch":
        more = t(new, cached, batch + extra, ctx_sum)
    else:
        assume(batch > 0)
        more = t(new, cached, batch, ctx_sum + extra)
    assert more >= base


# --- closed forms ----------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    cm=cost_models,
    batch=st.integers(1, 1024),
    avg_ctx=st.one_of(st.integers(0, 3_000), st.integers(0, 200_000)),
    extra=st.integers(0, 1023),
    n=st.integers(0, 3_000),
)
def test_decode_run_time_matches_loop(
    cm: CostModel, batch: int, avg_ctx: int, extra: int, n: int
) -> None:
    ctx_sum0 = batch * avg_ctx + extra
    closed = cm.decode_run_time(batch, ctx_sum0, n)
    assert math.isclose(closed, naive_decode_run(cm, batch, ctx_sum0, n), rel_tol=1e-9)


@pytest.mark.parametrize("cm", ALL_MODELS, ids=lambda cm: cm.preset.name)
def test_decode_run_time_across_the_crossover(cm: CostModel) -> None:
    """Runs that start compute-bound and end memory-bound: check that both regimes
    really occur, then compare the closed form with the loop at many lengths."""
    p = cm.preset
    overhead = p.tau + p.allreduce_s

    def compute_bound(batch: int, ctx_sum: int) -> bool:
        compute = batch * p.model.linear_flops_per_token / (p.tp * p.eta_gemm * p.gpu.flops)
        step = cm.iteration_time(0, 0, batch, ctx_sum)
        return math.isclose(step, overhead + compute, rel_tol=1e-12)

    n = 2_500
    crossings = 0
    for batch in (1, 7, 64, 256, 1024, 4096):
        for ctx_sum0 in (0, batch * 100, batch * 1000):
            last = ctx_sum0 + (n - 1) * batch
            if compute_bound(batch, ctx_sum0) and not compute_bound(batch, last):
                crossings += 1
            for k in (1, 17, 600, 1_299, n):
                assert math.isclose(
                    cm.decode_run_time(batch, ctx_sum0, k),
                    naive_decode_run(cm, batch, ctx_sum0, k),
                    rel_tol=1e-9,
                )
    if p.name in ("h200-80g-qwen2.5-7b", "test-compute-heavy"):
        assert crossings > 0


@settings(max_examples=200, deadline=None)
@given(
    cm=cost_models,
    batch=st.integers(1, 1024),
    avg_ctx=st.one_of(st.integers(0, 3_000), st.integers(0, 200_000)),
    n_max=st.integers(1, 2_000),
    frac=st.floats(0.0, 1.0),
)
def test_decode_iters_within_matches_loop(
    cm: CostModel, batch: int, avg_ctx: int, n_max: int, frac: float
) -> None:
    ctx_sum0 = batch * avg_ctx
    elapsed = frac * cm.decode_run_time(batch, ctx_sum0, n_max)
    n = cm.decode_iters_within(batch, ctx_sum0, elapsed)
    # Exact against the closed form it inverts.
    assert cm.decode_run_time(batch, ctx_sum0, n) <= elapsed
    assert cm.decode_run_time(batch, ctx_sum0, n + 1) > elapsed
    if elapsed > 0:  # the same as bisection; the inverted form's estimate is within one
        assert n == cm._decode_iters_bisect(batch, ctx_sum0, elapsed)
        assert abs(cm._decode_iters_estimate(batch, ctx_sum0, elapsed) - n) <= 1
    # Against the loop: equal unless elapsed sits on a boundary within rounding.
    total, n_loop = 0.0, 0
    while True:
        step = cm.iteration_time(0, 0, batch, ctx_sum0 + n_loop * batch)
        if total + step > elapsed:
            break
        total += step
        n_loop += 1
    if n != n_loop:
        boundary = naive_decode_run(cm, batch, ctx_sum0, max(n, n_loop))
        assert abs(n - n_loop) == 1
        assert math.isclose(boundary, elapsed, rel_tol=1e-9)


def test_decode_iters_within_edges() -> None:
    cm = CostModel(get_preset("h200-qwen3-30b-a3b"))
    assert cm.decode_iters_within(32, 32 * 1000, 0.0) == 0
    assert cm.decode_iters_within(32, 32 * 1000, -1.0) == 0
    one = cm.decode_run_time(32, 32 * 1000, 1)
    assert cm.decode_iters_within(32, 32 * 1000, one) == 1
    # A long horizon stays fast (logarithmic) and exact.
    n = cm.decode_iters_within(32, 32 * 1000, 3600.0)
    assert cm.decode_run_time(32, 32 * 1000, n) <= 3600.0 < cm.decode_run_time(32, 32 * 1000, n + 1)
    with pytest.raises(ValueError):
        cm.decode_iters_within(32, 0, math.inf)


# --- the CPU engine of the real-engine benchmark -----------------------------------


def test_cpu_tiny_llama_pool_is_the_engines_127_blocks() -> None:
    preset = get_preset("cpu-tiny-llama")
    assert preset.page_tokens == 32
    assert preset.gpu_kv_capacity_tokens == 4_064 == (128 - 1) * 32
    assert preset.model.context_window == 4_064
    assert CostModel(preset).gpu_kv_capacity_tokens == 4_064


def test_tiny_llama_parameters_from_its_config() -> None:
    # embeddings 552 x 128 twice; per layer q, o 128 x 128, k, v 128 x 64, MLP 3 x 128 x 256,
    # two norms of 128; a final norm of 128
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128
    assert TINY_LLAMA.embedding_params == 2 * 552 * 128
    assert TINY_LLAMA.params_total == 2 * 552 * 128 + 2 * layer + 128 == 436_864
    assert TINY_LLAMA.kv_bytes_per_token == 2 * 2 * 1 * 64 * 2  # 16 KiB per 32-token block


@pytest.mark.parametrize("scale", [0.5, 2.0, 10.0])
def test_engine_slowdown_multiplies_every_duration(scale: float) -> None:
    base = CostModel(get_preset("h200-qwen3-30b-a3b"))
    slow = CostModel(base.preset, engine_slowdown=scale)
    for args in [(8_192, prefill_attn_ctx(8_192, 1_000), 0, 0), (0, 0.0, 16, 40_000),
                 (512, prefill_attn_ctx(512, 0), 32, 100_000)]:
        assert slow.iteration_time(*args) == pytest.approx(scale * base.iteration_time(*args))
    assert slow.decode_run_time(16, 40_000, 300) == pytest.approx(
        scale * base.decode_run_time(16, 40_000, 300))
    assert slow.reload_time(10_000) == pytest.approx(scale * base.reload_time(10_000))
    elapsed = base.decode_run_time(16, 40_000, 123)
    assert slow.decode_iters_within(16, 40_000, scale * elapsed * (1 + 1e-12)) == 123


@pytest.mark.parametrize("scale", [0.0, -1.0, math.inf, math.nan])
def test_bad_engine_slowdown_is_refused(scale: float) -> None:
    with pytest.raises(ValueError, match="engine_slowdown"):
        CostModel(get_preset("h200-qwen3-30b-a3b"), engine_slowdown=scale)


# bench/calibrate_cpu_engine.py --reps 5 --reload, 2026-12-05 (the engine on one CPU of its
# own): the recorded medians the preset reproduces, one request each (its overhead included)
CPU_PREFILL_S = {63: 0.0101, 513: 0.0140, 1_023: 0.0229, 2_048: 0.0496, 3_500: 0.1179}
CPU_DECODE_STEP_S = 0.00246
CPU_FROM_HOST_TIER_S = {512: 0.0120, 1_024: 0.0137, 2_048: 0.0159, 3_500: 0.0209}


def test_cpu_tiny_llama_matches_its_recorded_calibration() -> None:
    cm = CostModel(get_preset("cpu-tiny-llama"))
    for tokens, seconds in CPU_PREFILL_S.items():
        assert cm.request_overhead + cm.prefill_time(tokens) == pytest.approx(seconds,
                                                                   rel=0.10), tokens
    assert cm.decode_run_time(1, 200, 1) == pytest.approx(CPU_DECODE_STEP_S, rel=0.10)
    for tokens, seconds in CPU_FROM_HOST_TIER_S.items():
        served = (cm.request_overhead + cm.reload_time(tokens)
                  + cm.iteration_time(1, prefill_attn_ctx(1, tokens - 1), 0, 0))
        assert served == pytest.approx(seconds, rel=0.10), tokens


def test_only_the_cpu_engine_has_a_request_overhead() -> None:
    assert get_preset("cpu-tiny-llama").request_overhead_s > 0
    assert all(PRESETS.get(name).request_overhead_s == 0 for name in PRESET_NAMES)


def test_prefill_time_sums_the_chunks_and_gives_the_recompute_rate() -> None:
    cm = CostModel(get_preset("cpu-tiny-llama"))
    chunk = cm.preset.chunk_size
    two = cm.prefill_chunk_time(chunk, 0) + cm.prefill_chunk_time(100, chunk)
    assert cm.prefill_time(chunk + 100) == pytest.approx(two)
    assert cm.prefill_time(0) == 0.0
    assert cm.prefill_rate(chunk + 100) == pytest.approx((chunk + 100) / two)
    with pytest.raises(ValueError, match="tokens"):
        cm.prefill_time(-1)
