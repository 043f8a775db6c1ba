"""Tests for the ``mori`` command line (run in-process through ``main``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mori import __version__
from mori.cli.main import main
from mori.core.costmodel import PRESETS
from mori.core.policies import POLICIES
from mori.sim.metrics import NONDETERMINISTIC_FIELDS

SMALL = ["simulate", "--duration", "120", "--programs", "2,3", "--policy", "mori,smg", "--quiet"]
REQUIRED_KEYS = {"policy", "programs", "hardware", "cpu_ratio", "replicas", "duration_s",
                 "output_tokens_per_s", "steps_per_s", "ttft_mean_s", "ttft_p90_s",
                 "gpu_busy_frac", "recomputed_tokens", "reloaded_tokens"}
SRC = Path(__file__).resolve().parents[2] / "src"


def run_json(tmp_path: Path, *extra: str, name: str = "out.json") -> list[dict[str, Any]]:
    out = tmp_path / name
    assert main([*SMALL, "--json", str(out), *extra]) == 0
    data: list[dict[str, Any]] = json.loads(out.read_text())
    return data


def deterministic(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in NONDETERMINISTIC_FIELDS} for r in rows]


def test_small_grid_json_in_grid_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = run_json(tmp_path, "--cpu-ratio", "0.5,1")
    grid = [(cpu, n, pol) for cpu in (0.5, 1.0) for n in (2, 3) for pol in ("mori", "smg")]
    assert [(r["cpu_ratio"], r["programs"], r["policy"]) for r in rows] == grid
    for r in rows:
        assert r.keys() >= REQUIRED_KEYS
        assert r["hardware"] == "h200-qwen3-30b-a3b"
        assert r["duration_s"] == 120
        assert r["replicas"] == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["policy", "programs", "hardware", "cpu"]
    assert "TTFT p90 (s)" in lines[0] and "reloaded (M tok)" in lines[0]
    # the p99 column stands right of the p90 one and shows each run's own value
    p90_at = lines[0].index("TTFT p90 (s)")
    p99_at = lines[0].index("TTFT p99 (s)")
    assert p99_at > p90_at
    shown = {(r["cpu_ratio"], r["programs"], r["policy"]): r for r in rows}
    for ln, (cpu, n, pol) in zip(lines[2:2 + len(grid)], grid, strict=True):
        cells = ln.split()
        p99 = shown[(cpu, n, pol)]["ttft_p99_s"]
        assert cells[8] == ("-" if p99 is None else format(p99, ".2f"))
    assert [ln.split()[0] for ln in lines[2:2 + len(grid)]] == [g[2] for g in grid]
    assert len(lines) == 2 + len(grid)  # --quiet: the table and nothing else


def test_plot_writes_png(tmp_path: Path) -> None:
    png = tmp_path / "fig.png"
    args = [*SMALL, "--cpu-ratio", "0,1", "--plot", str(png)]
    assert main(args) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


@pytest.mark.parametrize(("flag", "bad", "registry"),
                         [("--policy", "mori,nope", POLICIES), ("--preset", "tpu-v9", PRESETS)])
def test_unknown_name_lists_valid_names(flag: str, bad: str, registry: Any,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, flag, bad]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    for name in registry.names():
        assert name in err


def test_bad_values_exit_2_before_running(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--programs", "2,0"]) == 2
    assert "programs must be >= 1" in capsys.readouterr().err
    assert main([*SMALL, "--tick", "0"]) == 2
    assert "--tick: tick_s must be" in capsys.readouterr().err
    assert main([*SMALL, "--idleness-window", "0"]) == 2
    assert "--idleness-window: idleness_window must be >= 1" in capsys.readouterr().err
    assert main([*SMALL, "--programs", "two"]) == 2  # argparse's own error
    assert "--programs" in capsys.readouterr().err
    assert main([*SMALL, "--max-context", "1000"]) == 2  # SettingsError: nothing fits
    assert "--max-context" in capsys.readouterr().err


def test_broken_trace_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere.jsonl"
    assert main([*SMALL, "--traces", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "Traceback" not in err
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    assert main([*SMALL, "--traces", str(broken)]) == 2
    assert str(broken) in capsys.readouterr().err


def test_toml_config_and_cli_override(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('policy = ["smg"]\nprograms = [2, 3]\nduration = 60\n'
                   'cpu-ratio = 0.5\nhuman_gap = "replace"\njson = "from_config.json"\n')
    assert main(["simulate", "--quiet", "--config", str(cfg)]) == 0
    rows = json.loads((tmp_path / "from_config.json").read_text())  # relative to the file
    assert [(r["policy"], r["programs"], r["duration_s"], r["cpu_ratio"]) for r in rows] == [
        ("smg", 2, 60, 0.5), ("smg", 3, 60, 0.5)]
    out = tmp_path / "cli.json"
    assert main(["simulate", "--quiet", "--config", str(cfg), "--programs", "4",
                 "--duration", "30", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["programs"], r["duration_s"], r["cpu_ratio"]) for r in rows] == [
        ("smg", 4, 30, 0.5)]


def test_policy_knobs_reach_the_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("tick = 2\nidleness-window = 3\n")
    rows = run_json(tmp_path, "--config", str(cfg), "--idleness-window", "4")
    assert {(r["tick_s"], r["idleness_window"], r["binary_threshold"]) for r in rows} == {
        (2.0, 4, 0.5)}
    cfg.write_text("tick = 0\n")
    assert main([*SMALL, "--config", str(cfg)]) == 2
    assert "--tick: tick_s must be" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "expected"), [
    ("polcy = ['mori']\n", "unknown key 'polcy'"),
    ("programs = 'x'\n", "key 'programs'"),
    ("duration = [1, 2]\n", "key 'duration'"),
    ("programs = [2\n", "not valid TOML"),
])
def test_bad_toml_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                         expected: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    assert main(["simulate", "--quiet", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert expected in err and str(cfg) in err
    if "unknown key" in expected:
        assert "cpu-ratio" in err and "programs" in err  # the valid keys are listed


def test_jobs_give_the_same_results(tmp_path: Path) -> None:
    serial = run_json(tmp_path, "--jobs", "1", name="serial.json")
    parallel = run_json(tmp_path, "--jobs", "2", name="parallel.json")
    assert deterministic(parallel) == deterministic(serial)


def test_policies_and_presets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    for name in POLICIES.names():
        assert name in out
        assert POLICIES.get(name).description in out
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS.names():
        assert name in out
        assert f"{PRESETS.get(name).gpu_kv_capacity_tokens:,}" in out


def test_version_help_and_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out
    assert main(["simulate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "cpu ratio R" in out and "human gap" in out and "(default: 20,50,80)" in out
    assert main([]) == 2


def test_python_dash_m_mori() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "mori", "--version"], capture_output=True,
                          text=True, env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == f"mori {__version__}"


TINY_RUN = ["simulate", "--quiet", "--preset", "cpu-tiny-llama", "--policy", "smg,mori",
            "--programs", "2", "--duration", "60", "--token-scale", "0.01"]


def test_engine_model_options_reach_the_runs(tmp_path: Path) -> None:
    out = tmp_path / "tiny.json"
    assert main([*TINY_RUN, "--gpu-kv-tokens", "2050", "--cpu-kv-tokens", "1024",
                 "--engine-slowdown", "10", "--max-context", "150000", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["gpu_kv_tokens"], r["cpu_kv_tokens"], r["token_scale"],
             r["engine_slowdown"], r["gpu_kv_capacity_tokens"], r["cpu_kv_capacity_tokens"])
            for r in rows] == [("smg", 2050, 1024, 0.01, 10.0, 2048, 0),
                               ("mori", 2050, 1024, 0.01, 10.0, 2048, 1024)]
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('gpu-kv-tokens = 4064\ncpu_kv_tokens = 0\nengine-slowdown = 2\n'
                   'token_scale = 0.01\njson = "cfg.json"\n')
    assert main(["simulate", "--quiet", "--config", str(cfg), "--preset", "cpu-tiny-llama",
                 "--policy", "mori", "--programs", "2", "--duration", "30"]) == 0
    row = json.loads((tmp_path / "cfg.json").read_text())[0]
    assert (row["gpu_kv_capacity_tokens"], row["cpu_kv_capacity_tokens"], row["engine_slowdown"],
            row["max_context"]) == (4_064, 0, 2.0, 406_400)


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--token-scale", "0", "token_scale must be > 0"),
    ("--engine-slowdown", "-1", "engine_slowdown must be > 0"),
    ("--gpu-kv-tokens", "16", "gpu_kv_tokens must hold at least one page of 32 tokens"),
    ("--cpu-kv-tokens", "-5", "cpu_kv_tokens must be >= 0"),
    ("--engine-slowdown", "inf", "finite"),
])
def test_bad_engine_model_options_exit_2(capsys: pytest.CaptureFixture[str], flag: str,
                                         value: str, expected: str) -> None:
    assert main([*TINY_RUN, flag, value]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_traces_lists_the_shipped_sets(capsys: pytest.CaptureFixture[str]) -> None:
    from mori.cli.traces_cmd import format_size
    from mori.traces import SHIPPED_TRACES, default_traces

    assert main(["traces"]) == 0
    out = capsys.readouterr().out
    header, _, row, *rest = out.splitlines()
    assert header.split() == ["set", "programs", "subagents", "steps", "size", "licence",
                              "source"]
    size = format_size(SHIPPED_TRACES.get("kv-cache-tester-31").size_bytes())
    assert row.split()[:7] == ["kv-cache-tester-31*", "31", "0", "1,935", *size.split(),
                               "Apache-2.0"]
    assert sum(len(p.steps) for p in default_traces().programs) == 1935
    assert any("NOTICE" in line and "LICENSE-kv-cache-tester" in line for line in rest)
    assert main(["traces", "--help"]) == 0 and "--traces kv-cache-tester-31" in (
        capsys.readouterr().out)


def test_traces_option_takes_a_shipped_set_name(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # no file named like the set here
    default = run_json(tmp_path, name="default.json")
    named = run_json(tmp_path, "--traces", "kv-cache-tester-31", name="named.json")
    assert deterministic(named) == deterministic(default)
    capsys.readouterr()
    assert main([*SMALL, "--traces", "no-such-set"]) == 2
    err = capsys.readouterr().err
    assert "no-such-set: no such file or directory" in err
    assert "shipped trace set: kv-cache-tester-31" in err
    out = tmp_path / "sweep"
    assert main(["sweep", "smoke", "--out", str(out), "--quiet", "--jobs", "1",
                 "--traces", "kv-cache-tester-31"]) == 0
    assert json.loads((out / "sweep.json").read_text())["traces"]["name"] == "kv-cache-tester-31"


DP_RUN = ["simulate", "--policy", "smg", "--duration", "60", "--replicas", "2", "--programs", "3"]


def test_programs_are_per_replica(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "dp.json"
    assert main([*DP_RUN, "--quiet", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert (row["replicas"], row["programs_per_replica"], row["programs"]) == (2, 3, 6)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("DP=2 (programs column: per replica")
    assert lines[1].split()[:2] == ["policy", "programs"]
    assert lines[3].split()[:2] == ["smg", "3"]
    cfg = tmp_path / "dp.toml"
    cfg.write_text('policy = "smg"\nduration = 60\nreplicas = 2\nprograms = [3]\n'
                   'json = "cfg.json"\n')  # a config file means the same as the flags
    assert main(["simulate", "--quiet", "--config", str(cfg)]) == 0
    (same,) = json.loads((tmp_path / "cfg.json").read_text())
    assert deterministic([same]) == deterministic([row])


def test_help_says_programs_are_per_replica(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("simulate", "sweep"):
        assert main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "programs (closed-loop slots) PER REPLICA: a run simulates this x --replicas" \
            in text, command


def test_quiet_prints_the_table_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--policy", "smg", "--programs", "2", "--duration", "30",
                 "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert len(out.splitlines()) == 3 and out.startswith("policy")  # header, rule, one run
    assert main(["simulate", "--policy", "smg", "--programs", "2", "--duration", "30"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 3 and "left out" not in out
    assert "note: 11 of the 31 programs" in err  # notes go to stderr, without --quiet


@pytest.mark.parametrize("argv", [["traces"], ["presets"], ["trace", "stats",
                                                            "kv-cache-tester-31"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(argv: list[str]) -> None:
    """``mori ... | head -1``: no error message, the status of a SIGPIPE'd command."""
    import os
    import subprocess
    import sys

    src = Path(__file__).resolve().parents[2] / "src"
    proc = subprocess.Popen([sys.executable, "-m", "mori", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(src)})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the command writes (it is starting)
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert "Broken pipe" not in err and "Traceback" not in err, err


def test_former_spellings_still_work_and_warn(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """--hardware, --window and --time-scale (and their config keys) became --preset,
    --idleness-window and --engine-slowdown: the old ones give the same runs, with a
    warning."""
    new = run_json(tmp_path, "--preset", "h200-80g-qwen2.5-7b", "--idleness-window", "3",
                   "--engine-slowdown", "2")
    assert "deprecated" not in capsys.readouterr().err
    old = run_json(tmp_path, "--hardware", "h200-80g-qwen2.5-7b", "--window", "3",
                   "--time-scale", "2")
    err = capsys.readouterr().err
    for flag, instead in (("--hardware", "--preset"), ("--window", "--idleness-window"),
                          ("--time-scale", "--engine-slowdown")):
        assert f"mori: {flag} is deprecated and will be removed; use {instead}" in err
    def settings(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["hardware"], r["idleness_window"], r["engine_slowdown"]
    assert [settings(r) for r in old] == [settings(r) for r in new] == [
        ("h200-80g-qwen2.5-7b", 3, 2.0)] * len(new)
    cfg = tmp_path / "old.toml"
    cfg.write_text('hardware = "h200-80g-qwen2.5-7b"\nwindow = 3\ntime-scale = 2\n')
    rows = run_json(tmp_path, "--config", str(cfg))
    err = capsys.readouterr().err
    assert "config key 'hardware'" in err and "use 'preset'" in err
    assert "config key 'time-scale'" in err and "use 'engine-slowdown'" in err
    assert [settings(r) for r in rows] == [("h200-80g-qwen2.5-7b", 3, 2.0)] * len(rows)


def test_the_removed_pcie_gbps_is_an_unknown_flag_and_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--pcie-gbps (now --reload-gbps) is no longer read: the flag and the config key get
    the errors of any unknown option."""
    assert main([*SMALL, "--pcie-gbps", "7"]) == 2
    assert "unrecognized arguments: --pcie-gbps 7" in capsys.readouterr().err
    cfg = tmp_path / "old.toml"
    cfg.write_text("pcie-gbps = 7\n")
    assert main([*SMALL, "--config", str(cfg)]) == 2
    assert "unknown key 'pcie-gbps'" in capsys.readouterr().err


def test_disk_tier_flags_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--disk-ratio is a grid axis (one run per ratio), --disk picks the drive; the table
    gains a disk column and the disk's figures only when a run has a disk tier; a config
    file takes the same keys; bad values exit 2 with the reason."""
    rows = run_json(tmp_path, "--disk-ratio", "0,4", "--disk", "nvme-gen5-raid0x4",
                    "--preset", "b200-llama3.1-70b-tp2")
    assert [(r["disk_ratio"], r["programs"], r["policy"]) for r in rows][:4] == [
        (0.0, 2, "mori"), (0.0, 2, "smg"), (0.0, 3, "mori"), (0.0, 3, "smg")]
    assert {r["disk"] for r in rows} == {"nvme-gen5-raid0x4"}
    mori4 = next(r for r in rows if r["disk_ratio"] == 4.0 and r["policy"] == "mori")
    assert mori4["disk_kv_capacity_tokens"] == 4 * mori4["gpu_kv_capacity_tokens"]
    smg4 = next(r for r in rows if r["disk_ratio"] == 4.0 and r["policy"] == "smg")
    assert smg4["disk_kv_capacity_tokens"] == 0  # smg's engine has no host tier
    header = capsys.readouterr().out.splitlines()[0]
    assert header.split()[:5] == ["policy", "programs", "hardware", "cpu", "disk"]
    assert "disk hit %" in header and "disk written (TB)" in header
    assert main([*SMALL]) == 0
    assert "disk" not in capsys.readouterr().out.splitlines()[0]
    cfg = tmp_path / "disk.toml"
    cfg.write_text('policy = ["mori"]\nprograms = [2]\nduration = 60\n'
                   'disk-ratio = [2]\ndisk = "nvme-gen5"\nquiet = true\n')
    out = tmp_path / "cfg.json"
    assert main(["simulate", "--config", str(cfg), "--json", str(out)]) == 0
    assert [r["disk_ratio"] for r in json.loads(out.read_text())] == [2.0]
    capsys.readouterr()
    assert main([*SMALL, "--disk", "floppy"]) == 2
    err = capsys.readouterr().err
    assert "nvme-gen5" in err and "Traceback" not in err
    assert main([*SMALL, "--disk-ratio", "-1"]) == 2
    assert "disk ratio must be >= 0" in capsys.readouterr().err
    assert main([*SMALL, "--preset", "b200-llama3.1-70b-tp2", "--disk-ratio", "100"]) == 2
    assert "lower --disk-ratio or pick a larger --disk" in capsys.readouterr().err


def test_load_window_flag_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--load-window sets the time constant of the busy share mori prices drops by (0:
    an engine always busy); the record keeps it; a negative one is refused by name."""
    rows = run_json(tmp_path, "--load-window", "0")
    assert {r["load_window_s"] for r in rows} == {0.0}
    cfg = tmp_path / "lw.toml"
    cfg.write_text("load-window = 30\n")
    assert {r["load_window_s"] for r in run_json(tmp_path, "--config", str(cfg))} == {30.0}
    assert {r["load_window_s"] for r in run_json(tmp_path)} == {60.0}
    capsys.readouterr()
    assert main([*SMALL, "--load-window", "-1"]) == 2
    assert "load_window_s" in capsys.readouterr().err


def test_a_calibration_file_sets_the_engine_constants(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    base, calibrated = tmp_path / "base.json", tmp_path / "calibrated.json"
    assert main([*TINY_RUN, "--engine-slowdown", "10", "--json", str(base)]) == 0
    constants = {"tau": 0.05, "flops": 2e9, "eta_gemm": 0.5, "eta_attn": 0.5, "mem_bw": 2e10,
                 "eta_mem": 1.0, "request_overhead_s": 0.05}
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"constants": constants}))
    assert main([*TINY_RUN, "--engine-slowdown", "10", "--calibration", str(cal),
                 "--json", str(calibrated)]) == 0
    # the same engine, ten times slower per step: first tokens come later
    for fast, slow in zip(json.loads(base.read_text()), json.loads(calibrated.read_text()),
                          strict=True):
        assert slow["ttft_mean_s"] > 2 * fast["ttft_mean_s"]
    # a benchmark's results holding one are read too
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"settings": {"calibration": {"constants": constants}},
                                 "arms": []}))
    assert main([*TINY_RUN, "--duration", "10", "--calibration", str(bench)]) == 0
    capsys.readouterr()
    for text, expected in (("{", "cannot read it as JSON"), ('{"a": 1}', "no calibration in it"),
                           ("[" * 100_000, "cannot read it as JSON"),  # too deep to parse
                           ('{"constants": {"tau": 1}}', "the constant 'flops' is missing")):
        cal.write_text(text)
        assert main([*TINY_RUN, "--calibration", str(cal)]) == 2
        err = capsys.readouterr().err
        assert expected in err and str(cal) in err and "Traceback" not in err
