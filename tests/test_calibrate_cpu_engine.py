"""The fits of ``bench/calibrate_cpu_engine.py``: they recover the constants that made
the timings, so a calibration's preset reproduces what was measured."""

from __future__ import annotations

from types import ModuleType

import pytest

from bench import calibrate_cpu_engine
from mori.core.costmodel import CostModel, prefill_attn_ctx


@pytest.fixture(scope="module")
def cal() -> ModuleType:
    return calibrate_cpu_engine


def test_nnls_recovers_non_negative_coefficients(cal: ModuleType) -> None:
    rows = [(1.0, 0.0, 1.0), (2.0, 1.0, 1.0), (3.0, 4.0, 1.0), (5.0, 2.0, 1.0)]
    ys = [0.5 * u + 0.25 * v + 2.0 * w for u, v, w in rows]
    assert cal._nnls(rows, ys) == pytest.approx([0.5, 0.25, 2.0])
    # a fit that wants a negative coefficient gets 0 there instead
    ys = [-1.0 * u + 3.0 * w for u, _, w in rows]
    x = cal._nnls(rows, ys)
    assert min(x) >= 0 and x[0] == 0.0


def test_the_constants_reproduce_timings_made_by_a_known_preset(cal: ModuleType) -> None:
    truth = {"tau": 0.0024, "flops": 1.2e11, "eta_gemm": 1.0, "eta_attn": 0.5,
             "mem_bw": cal.NOMINAL_MEM_BW, "eta_mem": 1.0, "request_overhead_s": 0.008}
    cost = CostModel(cal.calibrated_preset(truth))
    points = [(n, cal.modelled_prefill(cost, n)) for n in (63, 512, 1_024, 2_048, 3_500)]
    step = cost.decode_run_time(1, cal.DECODE_PROMPT, 1)
    fitted = cal.preset_constants(points, step)
    assert fitted["request_overhead_s"] == pytest.approx(0.008, rel=0.02)
    assert fitted["tau"] == pytest.approx(0.0024, rel=0.02)
    refit = CostModel(cal.calibrated_preset(fitted))
    for n, seconds in points:
        assert cal.modelled_prefill(refit, n) == pytest.approx(seconds, rel=0.02)


def test_the_copy_rate_is_fitted_to_the_reloads(cal: ModuleType) -> None:
    c = {"tau": 0.0024, "flops": 1.2e11, "eta_gemm": 1.0, "eta_attn": 0.5,
         "mem_bw": cal.NOMINAL_MEM_BW, "eta_mem": 1.0, "request_overhead_s": 0.008,
         "copy_bw": 2.0e8}
    cost = CostModel(cal.calibrated_preset(c))
    reloads = [{"tokens": n, "host_tier_share": 1.0,
                "host_tier_s": cal.modelled_reload(cost, n, 1.0)} for n in (512, 2_048, 3_500)]
    assert cal.copy_bandwidth(c, reloads) == pytest.approx(2.0e8, rel=1e-6)
    # the copy is what is left after the overhead and the one token computed
    n = 2_048
    left = reloads[1]["host_tier_s"] - cost.request_overhead - cost.iteration_time(
        1, prefill_attn_ctx(1, n - 1), 0, 0)
    assert left == pytest.approx(n * cost.preset.kv_bytes_per_token_per_gpu / 2.0e8)
    assert cal.copy_bandwidth(c, []) is None


def test_the_tokenize_fit_is_a_line_never_below_zero(cal: ModuleType) -> None:
    fit = cal.tokenize_fit([(256, 0.0018), (1_026, 0.0025), (2_047, 0.0033)])
    assert fit["per_token_s"] == pytest.approx((0.0033 - 0.0018) / (2_047 - 256), rel=0.1)
    assert fit["fixed_s"] + fit["per_token_s"] * 1_026 == pytest.approx(0.0025, rel=0.05)
    # one size, or times that fall with size: a fixed cost only
    assert cal.tokenize_fit([(512, 0.002)]) == {"fixed_s": 0.002, "per_token_s": 0.0,
                                                 "points": [(512, 0.002)]}
    falling = cal.tokenize_fit([(256, 0.003), (2_048, 0.001)])
    assert falling["per_token_s"] == 0.0 and falling["fixed_s"] == pytest.approx(0.002)
    assert cal.tokenize_fit([])["fixed_s"] == 0.0
