"""An engine calibration: the cost model's engine constants as measured on one machine.

A preset's engine constants (per-iteration overhead, effective FLOP/s and efficiencies,
the fixed time per request, the host-tier copy rate) are starting estimates, or a
calibration of one day. A CPU engine on a shared machine can run several times slower
one day than another (``docs/costmodel.md``), so a simulation meant to predict a real
run uses a calibration taken beside it: ``bench/calibrate_cpu_engine.py --json FILE``
writes one, ``bench/bench_vllm_agents.py`` records one in its results, and
``mori simulate --calibration FILE`` and ``bench/sim_fidelity.py`` apply it to the
preset.

Pure data: no I/O here; the callers read the file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mori.core.hardware import HardwarePreset

__all__ = ["EngineCalibration"]


@dataclass(frozen=True, slots=True)
class EngineCalibration:
    """Engine constants fitted to one engine's timings (``bench/calibrate_cpu_engine.py``).

    ``tau``: seconds per iteration; ``flops``: effective FLOP/s, of which the linear layers
    run at ``eta_gemm`` and attention at ``eta_attn``; ``mem_bw`` x ``eta_mem``: bytes/s
    read; ``request_overhead_s``: the fixed time each request costs the engine beyond its
    tokens' compute; ``copy_bw``: bytes/s from the host tier (None: the preset's).
    """

    tau: float
    flops: float
    eta_gemm: float
    eta_attn: float
    mem_bw: float
    eta_mem: float
    request_overhead_s: float
    copy_bw: float | None = None

    def __post_init__(self) -> None:
        for name in ("tau", "request_overhead_s"):
            value = getattr(self, name)
            if not 0.0 <= value < math.inf:
                raise ValueError(f"calibration: {name} must be a finite number >= 0, "
                                 f"got {value!r}")
        for name in ("flops", "mem_bw"):
            value = getattr(self, name)
            if not 0.0 < value < math.inf:
                raise ValueError(f"calibration: {name} must be a finite number > 0, "
                                 f"got {value!r}")
        for name in ("eta_gemm", "eta_attn", "eta_mem"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"calibration: {name} must be in (0, 1], got {value!r}")
        if self.copy_bw is not None and not 0.0 < self.copy_bw < math.inf:
            raise ValueError(f"calibration: copy_bw must be a finite number > 0, "
                             f"got {self.copy_bw!r}")

    @classmethod
    def from_mapping(cls, constants: Mapping[str, Any]) -> EngineCalibration:
        """The calibration of ``constants`` (the ``constants`` object of a calibration
        file); a missing or non-numeric constant raises ``ValueError`` naming it."""
        values: dict[str, float | None] = {}
        for f in dataclasses.fields(cls):
            raw = constants.get(f.name)
            if raw is None:
                if f.name == "copy_bw":
                    values[f.name] = None
                    continue
                raise ValueError(f"calibration: the constant {f.name!r} is missing "
                                 f"(expected {', '.join(x.name for x in dataclasses.fields(cls))})")
            if isinstance(raw, bool) or not isinstance(raw, int | float):
                raise ValueError(f"calibration: {f.name} must be a number, got {raw!r}")
            values[f.name] = float(raw)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_document(cls, doc: Any) -> EngineCalibration:
        """The calibration a parsed JSON document holds: a calibration file's
        (``constants``, as ``bench/calibrate_cpu_engine.py --json`` writes it) or a
        benchmark's results' (``settings.calibration.constants``); ``ValueError`` saying
        what was expected where there is none."""
        if isinstance(doc, dict) and isinstance(doc.get("settings"), dict):
            doc = doc["settings"].get("calibration")
        constants = doc.get("constants") if isinstance(doc, dict) else None
        if not isinstance(constants, dict):
            raise ValueError("no calibration in it (expected an object with 'constants', as "
                             "bench/calibrate_cpu_engine.py --json writes, or a benchmark's "
                             "results with settings.calibration)")
        return cls.from_mapping(constants)

    def as_dict(self) -> dict[str, float]:
        """The constants, as a calibration file holds them (``copy_bw`` only if known)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.copy_bw is None:
            del out["copy_bw"]
        return out

    def applied_to(self, preset: HardwarePreset) -> HardwarePreset:
        """``preset`` with these engine constants (its model, pools and chunking kept)."""
        gpu = dataclasses.replace(preset.gpu, flops=self.flops, mem_bw=self.mem_bw,
                                  reload_bw=self.copy_bw or preset.gpu.reload_bw)
        return dataclasses.replace(preset, gpu=gpu, tau=self.tau, eta_gemm=self.eta_gemm,
                                   eta_attn=self.eta_attn, eta_mem=self.eta_mem,
                                   request_overhead_s=self.request_overhead_s)
