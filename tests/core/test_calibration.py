"""EngineCalibration: a calibration file's constants, checked, and applied to a preset."""

from __future__ import annotations

import dataclasses

import pytest

from mori.core.calibration import EngineCalibration
from mori.core.costmodel import CostModel, get_preset

CONSTANTS = {"tau": 0.005738, "flops": 1.914e10, "eta_gemm": 0.3651, "eta_attn": 1,
             "mem_bw": 2e10, "eta_mem": 1, "request_overhead_s": 0.009525, "copy_bw": 1.505e8}


def test_a_calibration_round_trips_and_sets_the_engine_constants() -> None:
    cal = EngineCalibration.from_mapping(CONSTANTS)
    assert cal.as_dict() == {k: float(v) for k, v in CONSTANTS.items()}
    base = get_preset("cpu-tiny-llama")
    preset = cal.applied_to(base)
    assert (preset.tau, preset.eta_gemm, preset.request_overhead_s) == (
        CONSTANTS["tau"], CONSTANTS["eta_gemm"], CONSTANTS["request_overhead_s"])
    assert (preset.gpu.flops, preset.gpu.reload_bw) == (CONSTANTS["flops"], CONSTANTS["copy_bw"])
    # what a calibration does not hold stays the preset's: the model, the pool, chunking
    assert (preset.model, preset.chunk_size, preset.gpu_kv_capacity_tokens) == (
        base.model, base.chunk_size, base.gpu_kv_capacity_tokens)
    # fewer FLOP/s at a lower efficiency: a prefill takes longer than the preset says
    assert CostModel(preset).prefill_time(2_048) > 2 * CostModel(base).prefill_time(2_048)


def test_without_a_copy_rate_the_preset_keeps_its_own() -> None:
    cal = EngineCalibration.from_mapping({k: v for k, v in CONSTANTS.items() if k != "copy_bw"})
    assert cal.copy_bw is None and "copy_bw" not in cal.as_dict()
    base = get_preset("cpu-tiny-llama")
    assert cal.applied_to(base).gpu.reload_bw == base.gpu.reload_bw


@pytest.mark.parametrize(("change", "message"), [
    ({"tau": None}, "the constant 'tau' is missing"),
    ({"flops": "fast"}, "flops must be a number"),
    ({"flops": True}, "flops must be a number"),
    ({"flops": 0.0}, "flops must be a finite number > 0"),
    ({"eta_gemm": 1.5}, "eta_gemm must be in (0, 1]"),
    ({"request_overhead_s": -1.0}, "request_overhead_s must be a finite number >= 0"),
    ({"copy_bw": float("inf")}, "copy_bw must be a finite number > 0"),
])
def test_a_bad_constant_is_named(change: dict[str, object], message: str) -> None:
    constants = {k: v for k, v in {**CONSTANTS, **change}.items() if v is not None}
    with pytest.raises(ValueError, match="calibration: ") as err:
        EngineCalibration.from_mapping(constants)
    assert message in str(err.value)


def test_a_calibration_is_frozen() -> None:
    cal = EngineCalibration.from_mapping(CONSTANTS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cal.tau = 1.0  # type: ignore[misc]


def test_a_document_holds_a_calibration_file_or_a_benchmarks_results() -> None:
    own = EngineCalibration.from_document({"constants": CONSTANTS})
    bench = EngineCalibration.from_document(
        {"settings": {"calibration": {"constants": CONSTANTS, "prefill": []}}, "arms": []})
    assert own == bench == EngineCalibration.from_mapping(CONSTANTS)
    for doc in ({}, [], None, {"settings": {"seed": 1}}, {"constants": [1, 2]}):
        with pytest.raises(ValueError, match="no calibration in it"):
            EngineCalibration.from_document(doc)
