"""Tests for ``mori sweep``: outputs, resume, --fresh, validation, the paper grid, Ray."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import mori.sweep.local
from mori.cli.main import main
from mori.core.policies import PAPER_POLICIES
from mori.core.policy import PolicyConfig
from mori.sim import MODEL_VERSION
from mori.sim.config import SimConfig
from mori.sim.metrics import NONDETERMINISTIC_FIELDS, RunResult
from mori.sim.runner import simulate
from mori.sweep import SWEEPS, expand, settings_of
from mori.sweep.grid import Run, Setting
from mori.sweep.run import partition
from mori.sweep.store import RECORD_FORMAT, RunStore, config_dict, result_from_dict, run_key
from mori.traces import default_traces

SMOKE_STEM = "h200-qwen3-30b-a3b_cpu1_dp1"


def deterministic(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in NONDETERMINISTIC_FIELDS} for r in rows]


def read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


class Counter:
    """Stands in for ``simulate`` in the executor (in-process runs, --jobs 1)."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.configs: list[SimConfig] = []
        self.interrupt_at = interrupt_at

    def __call__(self, config: SimConfig, traces: Any) -> RunResult:
        if self.interrupt_at is not None and len(self.configs) == self.interrupt_at:
            raise KeyboardInterrupt
        self.configs.append(config)
        return simulate(config, traces)


@pytest.fixture()
def counter(monkeypatch: pytest.MonkeyPatch) -> Counter:
    c = Counter()
    monkeypatch.setattr(mori.sweep.local, "simulate", c)
    return c


def smoke(out: Path, *extra: str) -> int:
    return main(["sweep", "smoke", "--out", str(out), "--quiet", *extra])


def test_smoke_writes_setting_json_png_and_sweep_json(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert smoke(out, "--jobs", "2") == 0  # the process-pool path
    rows = read(out / f"{SMOKE_STEM}.json")
    assert [(r["policy"], r["programs"], r["programs_per_replica"]) for r in rows] == [
        ("mori", 3, 3), ("smg", 3, 3)]
    assert all(r["duration_s"] == 60 and r["replicas"] == 1 for r in rows)
    png = (out / f"{SMOKE_STEM}.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    combined = read(out / "sweep.json")
    assert combined["sweep"] == "smoke"
    assert combined["runs"] == rows
    assert [s["json"] for s in combined["settings"]] == [f"{SMOKE_STEM}.json"]
    assert len(list((out / "runs").glob("*.json"))) == 2
    assert not list((out / "runs").glob(".*"))  # no temporary files left
    table = capsys.readouterr().out
    assert "DP=1" in table and "tok/s" in table


def test_resume_runs_only_missing_records(tmp_path: Path, counter: Counter,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert smoke(out, "--jobs", "1") == 0
    assert len(counter.configs) == 2
    first = read(out / "sweep.json")["runs"]
    records = sorted((out / "runs").glob("*.json"))
    deleted = read(records[0])
    records[0].unlink()
    counter.configs.clear()
    assert main(["sweep", "smoke", "--out", str(out), "--jobs", "1"]) == 0
    assert [c.policy for c in counter.configs] == [deleted["config"]["policy"]]
    assert "1 already recorded" in capsys.readouterr().err
    assert deterministic(read(out / "sweep.json")["runs"]) == deterministic(first)
    counter.configs.clear()
    assert smoke(out, "--only-missing", "--jobs", "1") == 0
    assert counter.configs == []  # everything recorded: nothing runs
    assert read(out / "sweep.json")["runs"] == read(out / f"{SMOKE_STEM}.json")


def test_fresh_reruns_and_stale_records_rerun(tmp_path: Path, counter: Counter) -> None:
    out = tmp_path / "out"
    assert smoke(out, "--jobs", "1") == 0
    counter.configs.clear()
    assert smoke(out, "--fresh", "--jobs", "1") == 0
    assert len(counter.configs) == 2
    assert len(list((out / "runs").glob("*.json"))) == 2  # overwritten, not added
    record = sorted((out / "runs").glob("*.json"))[0]
    record.write_text("{truncated", encoding="utf-8")  # unreadable: run again
    counter.configs.clear()
    assert smoke(out, "--jobs", "1") == 0
    assert len(counter.configs) == 1
    counter.configs.clear()
    assert smoke(out, "--jobs", "1", "--duration", "30") == 0  # another config: other keys
    assert len(counter.configs) == 2
    assert len(list((out / "runs").glob("*.json"))) == 4


def test_interrupted_sweep_keeps_finished_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    monkeypatch.setattr(mori.sweep.local, "simulate", Counter(interrupt_at=1))
    assert smoke(out, "--jobs", "1") == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    assert len(list((out / "runs").glob("*.json"))) == 1
    assert not (out / "sweep.json").exists()
    rest = Counter()
    monkeypatch.setattr(mori.sweep.local, "simulate", rest)
    assert smoke(out, "--jobs", "1") == 0
    assert [c.policy for c in rest.configs] == ["smg"]


def test_custom_sweep_replicas_are_per_replica_programs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["sweep", "--out", str(out), "--replicas", "1,2", "--programs", "2",
            "--policy", "smg", "--duration", "30", "--quiet", "--jobs", "1"]
    assert main(args) == 0
    for dp in (1, 2):
        (row,) = read(out / f"h200-qwen3-30b-a3b_cpu1_dp{dp}.json")
        assert (row["replicas"], row["programs"], row["programs_per_replica"]) == (dp, 2 * dp, 2)
        assert (out / f"h200-qwen3-30b-a3b_cpu1_dp{dp}.png").exists()
    meta = read(out / "sweep.json")
    assert meta["sweep"] is None
    # two replica counts of one preset and CPU ratio: a figure of how it scales
    assert meta["scaling"] == [{"hardware": "h200-qwen3-30b-a3b", "cpu_ratio": 1.0,
                                "png": "h200-qwen3-30b-a3b_cpu1_scaling.png"}]
    assert (out / "h200-qwen3-30b-a3b_cpu1_scaling.png").read_bytes().startswith(b"\x89PNG")


def test_one_replica_count_has_no_scaling_figure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert smoke(out, "--jobs", "1") == 0
    assert read(out / "sweep.json")["scaling"] == []
    assert not list(out.glob("*_scaling.png"))


def test_paper_definition_without_running_it() -> None:
    paper = SWEEPS.get("paper")
    runs = expand(paper)
    assert len(runs) == paper.size() == 120
    dp1 = [r for r in runs if r.setting.replicas == 1]
    dp3 = [r for r in runs if r.setting.replicas == 3]
    assert (len(dp1), len(dp3)) == (90, 30)
    assert {r.setting.hardware for r in dp1} == {
        "h200-80g-qwen2.5-7b", "h200-qwen3-30b-a3b", "b200-llama3.1-70b-tp2"}
    assert {r.setting.hardware for r in dp3} == {"h200-qwen3-30b-a3b"}
    assert {(r.programs_per_replica, r.config.programs) for r in dp3} == {
        (20, 60), (50, 150), (80, 240)}
    assert {r.config.policy for r in runs} == {*PAPER_POLICIES, "mori-paper"}
    assert {r.setting.cpu_ratio for r in runs} == {1.0, 2.0}
    assert {(r.config.duration_s, r.config.seed) for r in runs} == {(3600.0, 0)}
    assert len(settings_of(runs)) == 8
    assert [r.config.policy for r in runs[:5]] == [*PAPER_POLICIES, "mori-paper"]  # policy fastest


def test_never_loses_definition_without_running_it() -> None:
    nl = SWEEPS.get("never-loses")
    runs = expand(nl)
    assert len(runs) == nl.size() == 3 * 5 * 2 * 5 * 5
    assert {r.setting.cpu_ratio for r in runs} == {0.0, 0.25, 0.5, 1.0, 2.0}
    assert {r.setting.replicas for r in runs} == {1, 3}
    assert {r.programs_per_replica for r in runs} == {5, 10, 20, 50, 80}
    assert {r.config.policy for r in runs} == {
        "thunderagent", "thunderagent+offload", "lru-offload", "mori", "mori-paper"}


def test_fleet_definition_without_running_it() -> None:
    fleet = SWEEPS.get("fleet")
    runs = expand(fleet)
    assert len(runs) == fleet.size() == 12
    assert sorted({r.config.programs for r in runs}) == [1040, 3040, 10000]
    assert {(r.config.replicas, r.programs_per_replica) for r in runs} == {
        (13, 80), (38, 80), (125, 80)}
    assert {r.config.policy for r in runs} == set(PAPER_POLICIES)
    assert {(r.config.duration_s, r.config.cpu_ratio, r.config.hardware) for r in runs} == {
        (3600.0, 2.0, "h200-qwen3-30b-a3b")}


def test_list_and_bad_input(tmp_path: Path, counter: Counter,
                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "paper" in listing and "smoke" in listing and "120" in listing
    assert "never-loses" in listing and "750" in listing
    out = str(tmp_path / "out")
    assert main(["sweep", "nope", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "paper" in err and "smoke" in err and "Traceback" not in err
    assert main(["sweep", "smoke"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["sweep", "smoke", "--out", out, "--programs", "5"]) == 2
    assert "custom sweep" in capsys.readouterr().err
    assert main(["sweep", "--out", out, "--programs", "3,0", "--duration", "30"]) == 2
    assert "programs must be >= 1" in capsys.readouterr().err
    bad = ["sweep", "--out", out, "--programs", "2", "--duration", "30",
           "--preset", "h200-qwen3-30b-a3b,b200-llama3.1-70b-tp2", "--max-context", "9000000"]
    assert main(bad) == 2  # impossible on the second preset: refused before any run
    assert "GPU tier holds" in capsys.readouterr().err
    assert counter.configs == []
    assert not (tmp_path / "out" / "runs").exists()


def test_ray_missing_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert smoke(tmp_path / "out", "--ray") == 2
    err = capsys.readouterr().err
    assert "pip install 'mori[ray]'" in err and "Traceback" not in err


def test_result_from_dict_round_trips() -> None:
    result = simulate(SimConfig(programs=2, duration_s=30.0), default_traces())
    assert result_from_dict(result.to_dict()).to_dict() == result.to_dict()
    knobs = PolicyConfig(tick_s=2.0, idleness_window=3, binary_threshold=0.25)
    result = simulate(SimConfig(programs=2, duration_s=30.0, max_context=100_000,
                                policy_config=knobs), default_traces())
    back = result_from_dict(result.to_dict())
    assert back.config == result.config  # max_context given, knobs a record carries
    assert back.to_dict() == result.to_dict()
    with pytest.raises(ValueError, match="fields"):
        result_from_dict({**result.to_dict(), "extra": 1})


def test_config_dict_nests_the_policy_knobs_with_floats_as_floats() -> None:
    a = SimConfig(cpu_ratio=2, duration_s=60, policy_config=PolicyConfig(tick_s=5))
    b = SimConfig(cpu_ratio=2.0, duration_s=60.0, policy_config=PolicyConfig(tick_s=5.0))
    d = config_dict(a)
    assert d == config_dict(b) and run_key(a, "x") == run_key(b, "x")
    assert d["policy_config"] == {"tick_s": 5.0, "idleness_window": 5, "exclude_held": True,
                                  "binary_threshold": 0.5, "page_tokens": 64,
                                  "acting_token_weight": 1.0, "acting_token_decay": False,
                                  "reload_gbps": None, "max_wait_s": 3600.0,
                                  "load_window_s": 60.0}
    assert isinstance(d["cpu_ratio"], float) and isinstance(d["policy_config"]["tick_s"], float)
    assert json.loads(json.dumps(d)) == d
    other = SimConfig(duration_s=60, policy_config=PolicyConfig(idleness_window=4))
    assert run_key(other, "x") != run_key(SimConfig(duration_s=60), "x")


def test_sweep_policy_knobs_reach_every_run(tmp_path: Path, counter: Counter) -> None:
    assert smoke(tmp_path / "out", "--jobs", "1", "--tick", "2", "--idleness-window", "3") == 0
    assert {c.policy_config for c in counter.configs} == {
        PolicyConfig(tick_s=2.0, idleness_window=3)}
    rows = read(tmp_path / "out" / f"{SMOKE_STEM}.json")
    assert {(r["tick_s"], r["idleness_window"]) for r in rows} == {(2.0, 3)}


def test_sweep_takes_the_gpu_tiers_size(tmp_path: Path, counter: Counter) -> None:
    assert smoke(tmp_path / "out", "--jobs", "1", "--gpu-overcommit", "2",
                 "--gpu-overcommit-max", "8") == 0
    assert {c.policy_config for c in counter.configs} == {
        PolicyConfig(gpu_overcommit=2.0, gpu_overcommit_max=8.0)}


def test_ray_gives_the_local_results(tmp_path: Path) -> None:
    try:
        import ray
    except ImportError:
        pytest.skip("ray is not installed (it is in the test extra: pip install -e '.[test]')")
    started = time.perf_counter()
    assert smoke(tmp_path / "ray", "--ray", "--jobs", "2") == 0
    elapsed = time.perf_counter() - started
    assert not ray.is_initialized()  # the sweep shut down the instance it started
    assert smoke(tmp_path / "local", "--jobs", "2") == 0
    via_ray = read(tmp_path / "ray" / f"{SMOKE_STEM}.json")
    local = read(tmp_path / "local" / f"{SMOKE_STEM}.json")
    assert len(via_ray) == 2
    assert deterministic(via_ray) == deterministic(local)
    print(f"ray sweep: {elapsed:.1f} s")


def test_sweep_and_simulate_agree_on_programs_per_replica(tmp_path: Path) -> None:
    grid = ["--replicas", "2", "--programs", "3", "--policy", "smg", "--duration", "30",
            "--quiet"]
    assert main(["sweep", "--out", str(tmp_path / "out"), "--jobs", "1", *grid]) == 0
    swept = read(tmp_path / "out" / "h200-qwen3-30b-a3b_cpu1_dp2.json")
    assert main(["simulate", *grid, "--json", str(tmp_path / "sim.json")]) == 0
    simulated = read(tmp_path / "sim.json")
    assert deterministic(swept) == deterministic(simulated)
    assert [(r["programs_per_replica"], r["programs"]) for r in simulated] == [(3, 6)]


def test_sweep_quiet_prints_the_tables_and_nothing_else(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert smoke(tmp_path / "out", "--jobs", "1") == 0
    out, err = capsys.readouterr()
    assert err == "" and "left out" not in out
    assert out.splitlines()[0].startswith("h200-qwen3-30b-a3b, cpu ratio 1, DP=1")
    assert main(["sweep", "smoke", "--out", str(tmp_path / "out"), "--jobs", "1"]) == 0
    out, err = capsys.readouterr()
    assert "left out" not in out and "note: 11 of the 31 programs" in err


def test_settings_added_later_keep_the_keys_and_records_of_earlier_runs() -> None:
    cfg = SimConfig(duration_s=60)
    assert "reload_gbps" not in config_dict(cfg)  # at its default: the key is as before
    assert run_key(dataclasses.replace(cfg, reload_gbps=12.5), "x") != run_key(cfg, "x")
    row = simulate(SimConfig(programs=2, duration_s=30.0), default_traces()).to_dict()
    older = {k: v for k, v in row.items() if k not in ("reload_gbps", "policy_reload_gbps")}
    assert result_from_dict(older).to_dict() == row
    # the idle fill, off by default, leaves the keys of earlier runs as they were
    assert "fill_idle" not in config_dict(cfg)["policy_config"]
    assert result_from_dict({k: v for k, v in row.items() if k != "fill_idle"}).to_dict() == row


def _former_reload_names(record: dict[str, Any]) -> None:
    """Before the simulated link's reload bandwidth was ``reload_gbps``, a record held it
    as ``pcie_gbps`` and the policy's estimate as ``reload_gbps``."""
    row = record["result"]
    row["pcie_gbps"], row["reload_gbps"] = row["reload_gbps"], row.pop("policy_reload_gbps")


def _former_held_names(record: dict[str, Any]) -> None:
    """Before format 2, a record named the time a request is held ``gate_wait_mean_s``
    and the policy's knob ``exclude_gated``."""
    record["format"] = 1
    record["result"]["gate_wait_mean_s"] = record["result"].pop("held_mean_s")
    policy = record["config"]["policy_config"]
    policy["exclude_gated"] = policy.pop("exclude_held")


@pytest.mark.parametrize("former", [_former_reload_names, _former_held_names])
def test_records_with_former_names_are_run_again(tmp_path: Path, former: Any) -> None:
    """A record that spells a setting or a measurement by a former name is not read: its
    run is run again, as that of any record that does not match."""
    cfg = SimConfig(programs=2, duration_s=30.0, reload_gbps=20.0,
                    policy_config=PolicyConfig(reload_gbps=7.0))
    traces = default_traces()
    store = RunStore(tmp_path, traces)
    store.prepare()
    run = Run(Setting(cfg.hardware, cfg.cpu_ratio, cfg.replicas), 2, cfg)
    store.save(run, simulate(cfg, traces))
    assert store.load(run) is not None
    record = json.loads(store.path(run).read_text())
    former(record)
    if record["format"] == RECORD_FORMAT:  # the same key: the result itself is refused
        with pytest.raises(ValueError, match="fields"):
            result_from_dict(record["result"])
    store.path(run).write_text(json.dumps(record))
    assert store.load(run) is None
    assert partition([run], store, fresh=False) == ({}, [run])


def test_records_with_the_former_slowdown_name_keep_their_keys_and_load(
        tmp_path: Path) -> None:
    """``SimConfig.engine_slowdown`` was ``time_scale``: a run's key hashes it under that
    name (keys of earlier runs unchanged), and a record holding it so still loads."""
    cfg = SimConfig(programs=2, duration_s=30.0, engine_slowdown=3.0)
    assert config_dict(cfg)["engine_slowdown"] == 3.0
    former = {("time_scale" if k == "engine_slowdown" else k): v
              for k, v in config_dict(cfg).items()}
    payload = {"format": RECORD_FORMAT, "config": former, "traces": "x",
               "model": MODEL_VERSION}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    assert run_key(cfg, "x") == hashlib.sha256(text.encode()).hexdigest()[:24]
    row = simulate(cfg, default_traces()).to_dict()
    assert row["engine_slowdown"] == 3.0 and "time_scale" not in row
    older = {("time_scale" if k == "engine_slowdown" else k): v for k, v in row.items()}
    loaded = result_from_dict(older)
    assert loaded.config.engine_slowdown == 3.0 and loaded.to_dict() == row
    # a stored record with the former name in its config and result is found and read
    traces = default_traces()
    store = RunStore(tmp_path, traces)
    store.prepare()
    run = Run(Setting(cfg.hardware, cfg.cpu_ratio, cfg.replicas), 2, cfg)
    store.save(run, simulate(cfg, traces))
    record = json.loads(store.path(run).read_text())
    record["config"] = former
    record["result"] = older
    store.path(run).write_text(json.dumps(record))
    got = store.load(run)
    assert got is not None and got.to_dict() == row


def test_records_without_programs_per_replica_still_load() -> None:
    result = simulate(SimConfig(programs=4, replicas=2, duration_s=30.0), default_traces())
    row = result.to_dict()
    assert (row["programs"], row["programs_per_replica"]) == (4, 2)
    older = {k: v for k, v in row.items() if k != "programs_per_replica"}
    assert result_from_dict(older).to_dict() == row
    with pytest.raises(ValueError, match="programs_per_replica"):
        result_from_dict({**row, "programs_per_replica": 4})
