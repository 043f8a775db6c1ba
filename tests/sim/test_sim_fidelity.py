"""bench/sim_fidelity.py: the simulator against a (here synthetic) real-engine bench run."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bench import bench_vllm_agents, sim_fidelity
from mori.traces import default_traces


@pytest.fixture(scope="module")
def fidelity_mod() -> ModuleType:
    return sim_fidelity


def bench_doc(cpu_blocks: int) -> dict[str, Any]:
    settings = {"programs": 2, "duration_s": 60.0, "time_scale": 10.0, "token_scale": 0.01,
                "blocks": 128, "seed": 0, "cpu_blocks": cpu_blocks, "block_size": 32,
                "traces": default_traces().name, "arms": ["a", "b", "c", "d"]}

    def arm(name: str, gpu: int, cpu: int) -> dict[str, Any]:
        return {"arm": name, "name": f"arm {name}", "ok": True, "prompt_tokens": 10_000,
                "cached_tokens_gpu": gpu, "cached_tokens_cpu": cpu, "max_context": 370_000,
                "requests_completed": 17}

    return {"settings": settings,
            "arms": [arm("a", 5_000, 0), arm("b", 1, 1), arm("c", 1, 1),
                     arm("d", 4_000, 3_000)]}


def test_fidelity_rows_and_notes(fidelity_mod: ModuleType) -> None:
    report = fidelity_mod.fidelity(bench_doc(cpu_blocks=256), default_traces())
    # (a) and (b) ran with vLLM's own host tier: lru-offload and thunderagent+offload
    # (c), MORI's decisions on vLLM without the plug-in: mori on an LRU engine
    assert [(r["arm"], r["sim_policy"]) for r in report.rows] == [
        ("a", "lru-offload"), ("b", "thunderagent+offload"), ("c", "mori, no plug-in"),
        ("d", "mori")]
    a, b, c, d = report.rows
    assert a["real_cached_share"] == 0.5 and d["real_cached_share"] == 0.7
    for r in report.rows:
        assert r["sim_prompt_tokens"] > 0 and r["sim_requests_completed"] >= 0
        assert r["sim_cached_share"] == pytest.approx(
            r["sim_cached_share_gpu"] + r["sim_cached_share_cpu"])
        assert r["diff_pp"] == pytest.approx(100 * (r["sim_cached_share"] - r["real_cached_share"]))
        assert r["within"] == (abs(r["diff_pp"]) <= 10)
        assert r["real_requests_completed"] == 17 and r["real_runs"] == 1
        assert r["real_requests_per_s"] == pytest.approx(17 / 6.0)  # 60 s at time scale 10
        assert r["sim_requests_per_s"] == pytest.approx(r["sim_requests_completed"] / 6.0)
        assert r["rate_error"] == pytest.approx(r["sim_requests_per_s"] / (17 / 6.0) - 1)
        assert r["sim_gpu_kv_tokens"] == 127 * 32 and r["max_context"] == 370_000
    # the write-through host tier less its mirror of the GPU pool, for all (in (c) the
    # engine's own, which its policy does not see)
    assert [r["sim_cpu_kv_tokens"] for r in (a, b, c, d)] == [(256 - 127) * 32] * 4
    assert report.notes == []
    text = fidelity_mod.table(report.rows)
    assert "lru-offload" in text and "mori" in text and "within 10 pp" in text
    assert "within 15%" in text and f"{a['rate_error']:+.0%}" in text
    plain = fidelity_mod.fidelity(bench_doc(cpu_blocks=0), default_traces())
    assert [(r["arm"], r["sim_policy"], r["sim_cpu_kv_tokens"]) for r in plain.rows] == [
        ("a", "smg", 0), ("b", "thunderagent", 0), ("c", "mori, no plug-in", 0),
        ("d", "mori", 0)]


def test_rounds_give_medians_and_sizes_their_own_rows(fidelity_mod: ModuleType) -> None:
    doc = bench_doc(cpu_blocks=256)
    arms = []
    for size in (256, 128):
        for rnd, (gpu, done) in enumerate([(1_000, 10), (3_000, 30), (2_000, 20)], start=1):
            for name in ("a", "d"):
                arms.append({"arm": name, "name": name, "ok": True, "prompt_tokens": 10_000,
                             "cached_tokens_gpu": gpu + (500 if name == "d" else 0),
                             "cached_tokens_cpu": 0, "max_context": 370_000,
                             "requests_completed": done + (5 if name == "d" else 0),
                             "cpu_blocks": size, "round": rnd})
    arms.append({"arm": "d", "ok": False, "cpu_blocks": 128, "round": 4})
    doc["arms"] = arms
    report = fidelity_mod.fidelity(doc, default_traces())
    assert [(r["cpu_blocks"], r["arm"], r["real_runs"]) for r in report.rows] == [
        (256, "a", 3), (256, "d", 3), (128, "a", 3), (128, "d", 3)]
    for r in report.rows:  # the median round, not the first or the mean
        extra = 500 if r["arm"] == "d" else 0
        assert r["real_cached_share"] == pytest.approx((2_000 + extra) / 10_000)
        assert r["real_requests_completed"] == 20 + (5 if r["arm"] == "d" else 0)
    assert report.rows[2]["sim_cpu_kv_tokens"] == (128 - 127) * 32
    assert any("round 4" in n for n in report.notes)
    lines = fidelity_mod.orders(report.rows)
    assert len(lines) == 2 and all("real d > a" in line for line in lines)


def test_fidelity_main_writes_json(fidelity_mod: ModuleType, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(bench_doc(cpu_blocks=0)))
    out = tmp_path / "fidelity.json"
    assert fidelity_mod.main([str(bench), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(d) arm d" in printed and "--cpu-blocks 0" not in printed
    data = json.loads(out.read_text())
    assert [r["arm"] for r in data["rows"]] == ["a", "b", "c", "d"]
    assert data["rows"][3]["sim_cpu_kv_tokens"] == 0  # the bench ran without a host tier


def test_the_simulated_policy_gets_the_rates_the_gateway_was_told(
        fidelity_mod: ModuleType) -> None:
    doc = bench_doc(cpu_blocks=256)
    arm = doc["arms"][3]
    bench = bench_vllm_agents
    # a file from before the bench recorded them: today's preset, as the bench computes
    cfg = fidelity_mod.sim_config(doc["settings"], arm, "mori")
    expect = bench.policy_rates(10.0)
    assert (cfg.policy_config.recompute_tok_s, cfg.policy_config.reload_gbps) == expect
    # a file that records them: those
    doc["settings"]["policy_rates"] = {"recompute_tok_s": 123.0, "reload_gbps": 0.5}
    cfg = fidelity_mod.sim_config(doc["settings"], arm, "mori")
    assert (cfg.policy_config.recompute_tok_s, cfg.policy_config.reload_gbps) == (123.0, 0.5)


def test_malformed_rates_are_a_clear_error(fidelity_mod: ModuleType, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    doc = bench_doc(cpu_blocks=256)
    doc["settings"]["policy_rates"] = {"recompute_tok_s": "fast"}
    with pytest.raises(ValueError, match="policy_rates must hold"):
        fidelity_mod.rates_of(doc["settings"])
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert fidelity_mod.main([str(path)]) == 2
    assert "policy_rates must hold" in capsys.readouterr().err


def test_the_simulated_answers_are_as_long_as_the_engines(fidelity_mod: ModuleType) -> None:
    """The real arm's generated tokens per request (median over its rounds), rounded up,
    cut every simulated step's output; a file without those counts keeps the trace's."""
    doc = bench_doc(cpu_blocks=256)
    rounds = [dict(doc["arms"][0], generation_tokens=g, requests_completed=n, round=i)
              for i, (g, n) in enumerate([(30, 20), (25, 17), (40, 20)], start=1)]
    assert fidelity_mod.output_cap(rounds) == 2  # 1.5, 1.47, 2.0: median 1.5
    assert fidelity_mod.output_cap([dict(rounds[0], generation_tokens=20)]) == 1
    assert fidelity_mod.output_cap(doc["arms"][:1]) is None
    doc["arms"] = rounds
    (row,) = fidelity_mod.fidelity(doc, default_traces()).rows
    assert row["sim_max_output_tokens"] == 2
    cfg = fidelity_mod.sim_config(doc["settings"], rounds[0], "lru-offload", 2)
    assert cfg.max_output_tokens == 2
    assert "<= 2 tok" in fidelity_mod.table([row])


CALIBRATION = {"tau": 0.006, "flops": 2e10, "eta_gemm": 0.4, "eta_attn": 1.0, "mem_bw": 2e10,
               "eta_mem": 1.0, "request_overhead_s": 0.01, "copy_bw": 1.5e8}


def test_the_run_is_simulated_with_the_calibration_the_bench_recorded(
        fidelity_mod: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = bench_doc(cpu_blocks=256)
    arm = doc["arms"][3]
    assert fidelity_mod.sim_config(doc["settings"], arm, "mori").calibration is None
    doc["settings"]["calibration"] = {"constants": CALIBRATION, "prefill": [[256, 0.04]]}
    cfg = fidelity_mod.sim_config(doc["settings"], arm, "mori")
    assert cfg.calibration is not None and cfg.calibration.as_dict() == CALIBRATION
    # an engine far slower than the preset's completes fewer requests in the same window
    fast = fidelity_mod.fidelity(bench_doc(cpu_blocks=256), default_traces()).rows
    doc["settings"]["calibration"]["constants"] = {**CALIBRATION, "tau": 0.2,
                                                   "request_overhead_s": 0.5}
    slow = fidelity_mod.fidelity(doc, default_traces()).rows
    assert sum(r["sim_requests_completed"] for r in slow) < sum(
        r["sim_requests_completed"] for r in fast)
    # --calibration FILE replaces the recorded one; a broken one is a clear error
    bench, cal = tmp_path / "bench.json", tmp_path / "cal.json"
    bench.write_text(json.dumps(bench_doc(cpu_blocks=256)))
    cal.write_text(json.dumps({"constants": CALIBRATION}))
    assert fidelity_mod.main([str(bench), "--calibration", str(cal)]) == 0
    assert "as calibrated" in capsys.readouterr().out
    cal.write_text(json.dumps({"constants": {**CALIBRATION, "flops": "fast"}}))
    assert fidelity_mod.main([str(bench), "--calibration", str(cal)]) == 2
    assert "flops must be a number" in capsys.readouterr().err


def test_mori_serves_arms_read_the_engines_queue_where_the_run_did(
        fidelity_mod: ModuleType, tmp_path: Path) -> None:
    doc = bench_doc(cpu_blocks=256)
    arms = {a["arm"]: a for a in doc["arms"]}
    # a run recorded before the bench said so: no reading
    assert not fidelity_mod.sim_config(doc["settings"], arms["d"], "mori").engine_queues
    doc["settings"]["mori_reads_engine_queues"] = True
    assert [fidelity_mod.sim_config(doc["settings"], arms[a], "mori").engine_queues
            for a in "abcd"] == [False, False, True, True]
    # --engine-queues / --no-engine-queues override what the file says
    bench = tmp_path / "run.json"
    bench.write_text(json.dumps(doc))
    assert fidelity_mod.main([str(bench), "--no-engine-queues"]) == 0


def test_each_arm_spends_the_fronts_time_the_run_measured(fidelity_mod: ModuleType) -> None:
    """The client's hops plus the gateway's path (median over the rounds), in seconds;
    none where the run did not measure them, and never below 0."""
    assert fidelity_mod.front_of([{"arm": "a"}]) is None
    assert fidelity_mod.front_of([{"client_hop_mean_ms": 4.0}]) == pytest.approx(0.004)
    rounds = [{"client_hop_mean_ms": 5.0, "gateway_path_mean_ms": 20.0},
              {"client_hop_mean_ms": 3.0, "gateway_path_mean_ms": 40.0},
              {"client_hop_mean_ms": -9.0, "gateway_path_mean_ms": 1.0}]
    assert fidelity_mod.front_of(rounds) == pytest.approx(0.025)
    doc = bench_doc(cpu_blocks=256)
    for a in doc["arms"]:
        a.update({"client_hop_mean_ms": 2.0, "gateway_path_mean_ms": 30.0,
                  "ttft_p50_wall_s": 0.1, "ttft_p90_wall_s": 0.2})
    rows = fidelity_mod.fidelity(doc, default_traces()).rows  # off by default
    assert all(r["sim_front_ms"] is None for r in rows)
    assert rows[0]["real_ttft_p50_ms"] == pytest.approx(100.0)
    doc["settings"]["sim_fronts"] = True  # what --fronts sets
    rows = fidelity_mod.fidelity(doc, default_traces()).rows
    assert [r["sim_front_ms"] for r in rows] == pytest.approx([32.0] * 4)
    assert rows[0]["sim_ttft_p50_ms"] >= 32.0  # the fronts' time is in its TTFT


def test_the_tokenize_call_is_charged_where_the_gateway_made_it(
        fidelity_mod: ModuleType) -> None:
    """``mori serve --exact-tokens`` (the bench's) asks the engine's /tokenize for every
    request: its measured time at the arm's mean prompt is added to each request's engine
    time for arms (c) and (d); not for (a), nor where ``--mori-args`` said
    ``--no-exact-tokens``."""
    doc = bench_doc(cpu_blocks=256)
    doc["settings"]["calibration"] = {"constants": CALIBRATION,
                                      "tokenize": {"fixed_s": 0.002, "per_token_s": 1e-6}}
    arms = {a["arm"]: {**a, "requests_completed": 100} for a in doc["arms"]}
    base = CALIBRATION["request_overhead_s"]
    extra = 0.002 + 1e-6 * 10_000 / 100  # 10,000 prompt tokens over 100 requests

    def overhead(arm: str) -> float:
        cal = fidelity_mod.calibration_of(doc["settings"], arms[arm])
        return float(cal.request_overhead_s)

    assert overhead("a") == pytest.approx(base)
    assert overhead("c") == pytest.approx(base + extra)
    assert overhead("d") == pytest.approx(base + extra)
    doc["settings"]["mori_args"] = "--no-exact-tokens --no-fill-idle"
    assert overhead("d") == pytest.approx(base)


def test_the_runs_fill_idle_is_simulated(fidelity_mod: ModuleType) -> None:
    """``--mori-args=--fill-idle`` turned the rule on in ``mori serve`` (arms c and d):
    the simulation of those arms has it too, the last of ``--fill-idle`` and
    ``--no-fill-idle`` winning; plain vLLM's arm is not a MORI policy."""
    doc = bench_doc(cpu_blocks=256)
    arms = {a["arm"]: a for a in doc["arms"]}

    def fill(arm: str) -> bool:
        return bool(fidelity_mod.sim_config(doc["settings"], arms[arm], "mori")
                    .policy_config.fill_idle)

    assert not fill("d")
    doc["settings"]["mori_args"] = "--fill-idle"
    assert fill("c") and fill("d") and not fill("a")
    doc["settings"]["mori_args"] = "--fill-idle --no-fill-idle"
    assert not fill("d")


def test_the_runs_gpu_overcommit_is_simulated(fidelity_mod: ModuleType) -> None:
    """``--mori-args='--gpu-overcommit X'`` (or ``=X``) sized the GPU tier of ``mori
    serve``'s policy (arms c and d): their simulation has the same, the last value said
    winning; plain vLLM's arm is not a MORI policy."""
    doc = bench_doc(cpu_blocks=256)
    arms = {a["arm"]: a for a in doc["arms"]}

    def x(arm: str) -> float:
        return fidelity_mod.sim_config(doc["settings"], arms[arm], "mori") \
            .policy_config.gpu_overcommit

    assert x("d") == 1.0
    doc["settings"]["mori_args"] = "--fill-idle --gpu-overcommit 4"
    assert x("c") == x("d") == 4.0 and x("a") == 1.0
    doc["settings"]["mori_args"] = "--gpu-overcommit 4 --gpu-overcommit=2.5"
    assert x("d") == 2.5
    doc["settings"]["mori_args"] = "--gpu-overcommit-max 8"
    config = fidelity_mod.sim_config(doc["settings"], arms["d"], "mori").policy_config
    assert (config.gpu_overcommit, config.gpu_overcommit_max) == (1.0, 8.0)
