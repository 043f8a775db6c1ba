"""Modelling a given engine: KV pool overrides, token scale and engine slowdown of a run."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from mori.core.costmodel import get_preset
from mori.replay.client import _Replayer
from mori.sim.config import SimConfig
from mori.sim.metrics import RESULT_SETTINGS
from mori.sim.runner import Simulation, context_cut, simulate
from mori.sim.workload import scale_program, scale_tokens
from mori.traces import default_traces
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet

TINY = "cpu-tiny-llama"


def one_step(prompt: int = 1_000, output: int = 8) -> TraceSet:
    return TraceSet("one", (ProgramTrace("p", (Step(prompt, output, 0.0, GapKind.END),)),))


@pytest.mark.parametrize("bad", [
    dict(token_scale=0.0), dict(token_scale=-1.0), dict(token_scale=math.nan),
    dict(engine_slowdown=0.0), dict(engine_slowdown=math.inf), dict(engine_slowdown=-2.0),
    dict(gpu_kv_tokens=0), dict(hardware=TINY, gpu_kv_tokens=31),
    dict(cpu_kv_tokens=-1), dict(reload_gbps=-5.0),
    dict(reload_gbps=math.inf), dict(max_output_tokens=0),
])
def test_bad_engine_settings_are_refused(bad: dict[str, object]) -> None:
    name = next(k for k in bad if k != "hardware")
    with pytest.raises(ValueError, match=f"invalid simulation settings: .*{name}"):
        SimConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [0.01, 0.37, 1.0, 2.5])
def test_token_scale_rounds_as_the_replay_client(scale: float) -> None:
    replayer = SimpleNamespace(cfg=SimpleNamespace(token_scale=scale))
    for n in (0, 1, 49, 50, 51, 150, 250, 1_234, 99_999):
        assert scale_tokens(n, scale) == _Replayer.tokens(replayer, n)  # type: ignore[arg-type]


def test_scale_program_scales_every_count_and_subagents() -> None:
    child = ProgramTrace("c", (Step(300, 49, 0.0, GapKind.END),))
    p = ProgramTrace("p", (
        Step(1_250, 150, 1.0, GapKind.SUBAGENT, 0, (SubagentSpawn(0.5, child),)),
        Step(2_000, 20, 0.0, GapKind.END, 1_240),
    ), shared_prefix_tokens=900)
    q = scale_program(p, 0.01)
    assert [(s.prompt_tokens, s.reuse_tokens, s.output_tokens) for s in q.steps] == [
        (12, 0, 2), (20, 12, 1)]
    assert q.shared_prefix_tokens == 9
    assert q.steps[0].subagents[0].program.steps[0].prompt_tokens == 3
    assert q.steps[0].gap_s == 1.0 and q.steps[0].subagents[0].delay_s == 0.5
    assert scale_program(p, 1.0) is p


def test_scale_program_keeps_a_recorded_uncached_count_within_the_prompt() -> None:
    """A step's ``new_tokens`` (synthetic and recorded traces carry it) scales with its
    prompt; it was left whole, past the scaled prompt, and the step refused itself."""
    p = ProgramTrace("p", (Step(24_325, 3, 2.0, GapKind.TOOL, new_tokens=24_325),
                           Step(25_000, 3, 0.0, GapKind.END, 24_325, new_tokens=675),
                           Step(25_100, 3, 0.0, GapKind.END, 25_000, new_tokens=0)))
    q = scale_program(p, 0.01)
    assert [(s.prompt_tokens, s.new_tokens) for s in q.steps] == [(243, 243), (250, 7), (251, 0)]


def test_the_engine_sees_scaled_tokens() -> None:
    cfg = SimConfig(policy="smg", programs=1, duration_s=100, stagger_s=0, hardware=TINY,
                    token_scale=0.01)
    r = simulate(cfg, one_step(prompt=150_000, output=250))
    assert r.steps >= 1
    assert r.prompt_tokens % 1_500 == 0 and r.prompt_tokens >= r.steps * 1_500
    assert r.output_tokens >= r.steps * 2  # round(2.5) == 2


def test_answers_are_cut_at_max_output_tokens() -> None:
    """An engine whose model ends its answers early: each request decodes at most the
    cap (after the token scale), the prompts unchanged."""
    cfg = SimConfig(policy="smg", programs=1, duration_s=100, stagger_s=0, hardware=TINY,
                    token_scale=0.01)
    full = simulate(cfg, one_step(prompt=150_000, output=900))
    cut = simulate(dataclasses.replace(cfg, max_output_tokens=3),
                   one_step(prompt=150_000, output=900))
    assert full.steps >= 1 and full.output_tokens >= full.steps * 9
    assert cut.steps >= full.steps and cut.output_tokens == cut.steps * 3
    assert cut.prompt_tokens % 1_500 == 0 and cut.prompt_tokens >= cut.steps * 1_500
    assert "max_output_tokens" in RESULT_SETTINGS


def test_max_context_stays_in_trace_tokens() -> None:
    window = get_preset(TINY).model.context_window
    assert context_cut(SimConfig(hardware=TINY, token_scale=0.01)) == window * 100
    assert context_cut(SimConfig(hardware=TINY, token_scale=0.01, max_context=300_000)) == 300_000
    assert context_cut(SimConfig(hardware=TINY)) == window
    # 300,000 trace tokens fit the cut of 406,400, and 3,000 engine tokens the pool
    r = simulate(SimConfig(policy="smg", programs=1, duration_s=50, stagger_s=0,
                           hardware=TINY, token_scale=0.01), one_step(prompt=300_000))
    assert r.max_context == window * 100 and r.programs_left_out == 0


def test_engine_slowdown_multiplies_engine_durations() -> None:
    def ttft(scale: float) -> float:
        cfg = SimConfig(policy="smg", programs=1, duration_s=1_000, stagger_s=0,
                        hardware=TINY, engine_slowdown=scale)
        return simulate(cfg, one_step()).ttft_mean_s

    one, two = ttft(1.0), ttft(2.0)
    assert one > 0
    assert two == pytest.approx(2 * one, rel=1e-9)


def test_reload_gbps_sets_the_reload_bandwidth() -> None:
    def sim(**kw: object) -> Simulation:
        return Simulation(SimConfig(policy="mori", programs=30, duration_s=600, **kw),  # type: ignore[arg-type]
                          default_traces())

    base = sim().cost.reload_time(100_000)
    assert base == pytest.approx(100_000 * get_preset("h200-qwen3-30b-a3b").kv_bytes_per_token_per_gpu
                                 / 50e9)
    assert sim(reload_gbps=5.0).cost.reload_time(100_000) == pytest.approx(10 * base)
    assert sim(reload_gbps=50.0).run().to_dict()["reload_gbps"] == 50.0
    # reload-heavy: mori's steps wait longer for their KV on a slower link
    fast = sim().run()
    slow = sim(reload_gbps=0.5).run()
    assert fast.reloaded_tokens > 0
    assert slow.ttft_mean_s > fast.ttft_mean_s


def test_gpu_kv_tokens_override_the_presets_pool() -> None:
    cfg = SimConfig(policy="smg", programs=1, duration_s=30, hardware=TINY, gpu_kv_tokens=1_000)
    r = simulate(cfg, one_step(prompt=500))
    assert r.gpu_kv_capacity_tokens == 992  # 31 whole pages of 32
    assert simulate(SimConfig(policy="smg", programs=1, duration_s=30, hardware=TINY),
                    one_step(prompt=500)).gpu_kv_capacity_tokens == 4_064


def test_cpu_kv_tokens_override_the_cpu_ratio() -> None:
    def cpu(policy: str, **kw: object) -> int:
        cfg = SimConfig(policy=policy, programs=1, duration_s=30, hardware=TINY, **kw)  # type: ignore[arg-type]
        return Simulation(cfg, one_step(prompt=500)).run().cpu_kv_capacity_tokens

    assert cpu("mori", cpu_ratio=5.0) == 5 * 4_064
    assert cpu("mori", cpu_ratio=5.0, cpu_kv_tokens=8_200) == 8_192  # whole pages
    assert cpu("mori", cpu_ratio=5.0, cpu_kv_tokens=0) == 0
    assert cpu("smg", cpu_kv_tokens=8_192) == 0  # its engine has no CPU tier


def test_the_record_carries_the_engine_settings() -> None:
    cfg = SimConfig(policy="mori", programs=2, duration_s=30, hardware=TINY,
                    gpu_kv_tokens=2_048, cpu_kv_tokens=4_096, token_scale=0.01, engine_slowdown=10,
                    max_context=150_000)
    row = simulate(cfg, default_traces()).to_dict()
    assert list(row)[:len(RESULT_SETTINGS)] == list(RESULT_SETTINGS)
    assert {k: row[k] for k in ("gpu_kv_tokens", "cpu_kv_tokens", "token_scale",
                                "engine_slowdown")} == {"gpu_kv_tokens": 2_048,
                                                   "cpu_kv_tokens": 4_096,
                                                   "token_scale": 0.01, "engine_slowdown": 10}
    assert (row["gpu_kv_capacity_tokens"], row["cpu_kv_capacity_tokens"]) == (2_048, 4_096)


def test_a_reload_bandwidth_of_zero_is_no_cpu_tier() -> None:
    """0 GB/s: nothing could be reloaded, so no CPU tier is simulated; every policy runs
    and the runs equal those at CPU ratio 0."""
    from mori.sim.runner import simulate
    from mori.traces import default_traces

    for policy in ("mori", "mori-paper", "mori-ski", "mori-yield", "lru-offload",
                   "thunderagent+offload"):
        cut = SimConfig(policy=policy, programs=6, duration_s=300.0, reload_gbps=0.0)
        none = SimConfig(policy=policy, programs=6, duration_s=300.0, cpu_ratio=0.0)
        a, b = simulate(cut, default_traces()), simulate(none, default_traces())
        assert a.cpu_kv_capacity_tokens == 0 and a.reloaded_tokens == 0
        assert (a.steps, a.output_tokens) == (b.steps, b.output_tokens), policy


def test_a_recompute_is_priced_at_a_context_the_model_holds() -> None:
    # the tiny CPU model holds 4,064 tokens: its rate, not one at 32k it cannot reach
    cfg = SimConfig(policy="mori", programs=1, duration_s=10, hardware=TINY, engine_slowdown=100)
    sim = Simulation(cfg, one_step())
    cost = sim.cost
    assert sim.policy.config.recompute_tok_s == pytest.approx(cost.prefill_rate(4_064))
    assert cost.prefill_rate(4_064) > 5 * cost.prefill_rate(32_768)
    big = Simulation(SimConfig(policy="mori", programs=1, duration_s=10), one_step())
    assert big.policy.config.recompute_tok_s == pytest.approx(big.cost.prefill_rate(32_768))
