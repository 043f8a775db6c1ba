"""The real-engine benchmark's engine in the simulator: without MORI's plug-in
(``SimConfig.plugin`` False, ``mori serve`` on plain vLLM, the benchmark's arm (c)),
calibrated beside the run, its reloads priced as a gateway learns them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mori.core.calibration import EngineCalibration
from mori.sim.config import SimConfig
from mori.sim.runner import Simulation
from mori.traces import default_traces

# the real-engine benchmark's engine: 255 usable blocks of 32 tokens, a 512-block host tier
BASE = SimConfig(policy="mori", programs=16, hardware="cpu-tiny-llama", duration_s=1500.0,
                 seed=1, max_context=378_058, gpu_kv_tokens=255 * 32,
                 cpu_kv_tokens=(512 - 255) * 32, token_scale=0.01, engine_slowdown=100.0,
                 max_output_tokens=2)


def test_the_engine_keeps_its_host_tier_and_the_policy_does_not_see_it() -> None:
    traces = default_traces()
    with_plugin = Simulation(BASE, traces)
    without = Simulation(dataclasses.replace(BASE, plugin=False), traces)
    assert with_plugin.policy.cluster.cpu_bytes and with_plugin.policy.cluster.cpu_bytes > 0
    assert without.policy.cluster.cpu_bytes == 0  # the policy sees no host tier
    assert without.cpu_pages == with_plugin.cpu_pages > 0  # the engine keeps one
    assert not without.executor.profile.typed_eviction
    assert not without.executor.profile.drops_on_demote
    result = without.run()
    # the engine's own write-through tier serves what its LRU pushed off the GPU
    assert result.cpu_hit_rate > 0 and result.steps > 0


def test_a_calibration_changes_the_simulated_engine() -> None:
    slow = EngineCalibration(tau=0.05, flops=2e9, eta_gemm=0.5, eta_attn=0.5, mem_bw=2e10,
                             eta_mem=1.0, request_overhead_s=0.05)
    base = Simulation(BASE, default_traces())
    calibrated = Simulation(dataclasses.replace(BASE, calibration=slow), default_traces())
    assert calibrated.cost.preset.tau == 0.05 != base.cost.preset.tau
    assert calibrated.cost.prefill_time(1_024) > 5 * base.cost.prefill_time(1_024)


def test_the_policy_prices_a_park_by_the_engine_time_its_reload_takes() -> None:
    """On an engine whose reloads take its own time (``reload_on_engine``), the policy
    gets the price ``mori serve --learn-costs`` would learn; ``learn_costs`` False, none."""
    traces = default_traces()
    learned = Simulation(BASE, traces)
    costs = learned.policy.engine_costs[0]
    assert costs is not None and costs.reload_fixed_s == 0.0
    per_token = learned.cost.reload_time(1_000_000) / 1_000_000
    assert costs.reload_per_token_s == per_token > 0
    plain = Simulation(dataclasses.replace(BASE, learn_costs=False), traces)
    assert plain.policy.engine_costs[0] is None
    # an engine whose link overlaps the compute (the GPU presets): nothing to learn
    gpu = Simulation(SimConfig(policy="mori", programs=4, duration_s=60.0), traces)
    assert gpu.policy.engine_costs[0] is None


def test_the_policy_reads_the_engines_queue_only_when_told() -> None:
    """``engine_queues``: the policy is told the engine's waiting count at each decision,
    as ``mori serve`` reads it; the engine of this setting queues (one at a time on the
    CPU), so the replica's queue share is above 0 at the end, and the moves differ. Off
    (the default): never told, the share stays 0."""
    traces = default_traces()
    reading = Simulation(dataclasses.replace(BASE, engine_queues=True), traces)
    r1 = reading.run()
    assert reading.policy.load.queue_share(0, reading.loop.now) > 0
    blind = Simulation(BASE, traces)
    r0 = blind.run()
    assert blind.policy.load.queue_share(0, blind.loop.now) == 0
    assert r1.steps > 0 and r0.steps > 0
    assert (r1.steps, r1.recomputed_tokens) != (r0.steps, r0.recomputed_tokens)


def test_the_fronts_time_delays_each_request_and_shows_in_its_ttft() -> None:
    """``front_s``: each request reaches the policy that much later (scaled as the
    engine's durations are); its TTFT counts the delay, the gateway's hold does not, and
    a closed loop with longer round trips completes fewer steps."""
    traces = default_traces()
    base = dataclasses.replace(BASE, programs=4, duration_s=600.0)
    plain = Simulation(base, traces).run()
    slow = Simulation(dataclasses.replace(base, front_s=0.05), traces).run()
    front = 0.05 * base.engine_slowdown  # 5 s of the engine's clock
    assert slow.ttft_p50_s >= plain.ttft_p50_s + 0.9 * front
    assert slow.steps < plain.steps
    assert slow.held_mean_s < front  # the delay is not counted as held
    for bad in (-0.01, math.inf, math.nan):
        with pytest.raises(ValueError, match="front_s"):
            dataclasses.replace(base, front_s=bad)
