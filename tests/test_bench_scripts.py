"""The benchmark scripts run: each, on a tiny setting, exits 0 and prints its table.

They are not timed here (speed is measured by running them, docs/benchmarks.md); this
catches a script left behind by a change of names (a renamed flag or setting)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script, args, expect", [
    ("bench_sim.py", ["--programs", "4", "--duration", "60", "--policies", "smg,mori", "--repeat", "2"],
     "mori"),
    ("ta_churn.py", ["--programs", "4", "--replicas", "2"], "pause"),
    ("provider_shapes.py", ["--out", "{tmp}", "--sweep", "smoke", "--programs", "20"],
     "tool calls under 2 s"),
])
def test_bench_script_runs(script: str, args: list[str], expect: str, tmp_path: Path) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert expect in out.stdout


def test_never_loses_reads_a_sweep(tmp_path: Path) -> None:
    """bench/never_loses.py on a one-cell sweep: the table, and the ratio it prints is
    mori's throughput over the best baseline's."""
    from mori.cli.main import main

    out = tmp_path / "nl"
    assert main(["sweep", "--out", str(out), "--policy", "mori,thunderagent,lru-offload",
                 "--programs", "3", "--duration", "60", "--jobs", "1", "--quiet"]) == 0
    res = subprocess.run([sys.executable, str(BENCH / "never_loses.py"), str(out),
                          "--plot", str(tmp_path / "nl.png")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    runs = {r["policy"]: r["output_tokens_per_s"]
            for r in json.loads((out / "sweep.json").read_text())["runs"]}
    ratio = runs["mori"] / max(runs["thunderagent"], runs["lru-offload"])
    assert f"{ratio:8.3f}".strip() in res.stdout
    assert (tmp_path / "nl.png").stat().st_size > 0
    # the bar of never losing: met at a bar below the ratio, not above it (--strict: exit 1)
    low = subprocess.run([sys.executable, str(BENCH / "never_loses.py"), str(out), "--strict",
                          "--cell-bar", f"{ratio - 0.01:.3f}", "--run-bar", "0"],
                         capture_output=True, text=True, timeout=300)
    assert low.returncode == 0 and ": met" in low.stdout, low.stdout[-1000:]
    high = subprocess.run([sys.executable, str(BENCH / "never_loses.py"), str(out), "--strict",
                           "--cell-bar", f"{ratio + 0.01:.3f}"],
                          capture_output=True, text=True, timeout=300)
    assert high.returncode == 1 and "NOT met" in high.stdout, high.stdout[-1000:]


def test_never_loses_takes_the_median_over_seeds(tmp_path: Path) -> None:
    """Two seeds' folders read together: the cell's figure is the median of the seeds'
    ratios (the mean of two), and the lowest run is the lower of them."""
    import json

    from mori.cli.main import main

    per_seed = []
    for seed in (0, 1):
        out = tmp_path / f"nl-{seed}"
        assert main(["sweep", "--out", str(out), "--policy", "mori,thunderagent,lru-offload",
                     "--programs", "6", "--duration", "120", "--seed", str(seed),
                     "--jobs", "1", "--quiet"]) == 0
        runs = {r["policy"]: r["output_tokens_per_s"]
                for r in json.loads((out / "sweep.json").read_text())["runs"]}
        per_seed.append(runs["mori"] / max(runs["thunderagent"], runs["lru-offload"]))
    res = subprocess.run([sys.executable, str(BENCH / "never_loses.py"),
                          str(tmp_path / "nl-0"), str(tmp_path / "nl-1")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "median over seeds 0,1" in res.stdout
    assert f"{sum(per_seed) / 2:8.3f}".strip() in res.stdout
    assert f"lowest {min(per_seed):.3f}" in res.stdout


def test_disk_tier_reads_a_sweep(tmp_path: Path) -> None:
    """bench/disk_tier.py on a custom sweep with a disk axis (also the sweep's
    --disk-ratio): the ratio it prints is mori with the disk over mori without, and the
    sweep wrote one setting per disk ratio."""
    from mori.cli.main import main

    out = tmp_path / "disk"
    assert main(["sweep", "--out", str(out), "--policy", "mori,lru-offload",
                 "--preset", "b200-llama3.1-70b-tp2", "--programs", "30",
                 "--disk-ratio", "0,4", "--duration", "300", "--jobs", "1",
                 "--quiet"]) == 0
    import json

    meta = json.loads((out / "sweep.json").read_text())
    assert [s.get("disk_ratio", 0.0) for s in meta["settings"]] == [0.0, 4.0]
    assert (out / "b200-llama3.1-70b-tp2_cpu1_disk4_dp1.json").exists()
    res = subprocess.run([sys.executable, str(BENCH / "disk_tier.py"), str(out),
                          "--target", "b200-llama3.1-70b-tp2,1,30",
                          "--plot", str(tmp_path / "d.png")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    runs = {(r["policy"], r["disk_ratio"]): r["output_tokens_per_s"] for r in meta["runs"]}
    ratio = runs[("mori", 4.0)] / runs[("mori", 0.0)]
    assert f"disk ratio 4: {ratio:.3f}" in res.stdout
    assert (tmp_path / "d.png").stat().st_size > 0


def test_results_table_per_replica(tmp_path: Path) -> None:
    """scripts/results_table.py --replicas 2 on a two-replica sweep: one row per policy
    with its throughput and a figure per replica; the one-replica table skips it."""
    from mori.cli.main import main

    out = tmp_path / "dp2"
    assert main(["sweep", "--out", str(out), "--policy", "mori,thunderagent",
                 "--programs", "3", "--replicas", "2", "--duration", "60", "--jobs", "1",
                 "--quiet"]) == 0
    script = BENCH.parent / "scripts" / "results_table.py"
    res = subprocess.run([sys.executable, str(script), str(out / "sweep.json"),
                          "--replicas", "2"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    runs = json.loads((out / "sweep.json").read_text())["runs"]
    mori = next(r for r in runs if r["policy"] == "mori")
    row = next(line for line in res.stdout.splitlines() if "| MORI |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == f"{mori['output_tokens_per_s']:.0f}"
    assert len(cells[5].split(" / ")) == 2  # GPU busy, one figure per replica
    one = subprocess.run([sys.executable, str(script), str(out / "sweep.json")],
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and "MORI" not in one.stdout


def test_predicted_returns_reads_the_tools_off_recorded_claude_code_sessions(
        tmp_path: Path) -> None:
    """On the recorded Claude Code sessions, the tools a response called predict its tool
    call's length better than the program's own history or the fleet's (the measured
    claim of ``mori.core.returns``)."""
    import json
    data = Path(__file__).resolve().parent / "data" / "claude-code"
    out = subprocess.run([sys.executable, str(BENCH / "predicted_returns.py"), str(data),
                          "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["rule"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert rows["tools"]["calls"] > 200
    assert rows["tools"]["median_abs_s"] < rows["own"]["median_abs_s"]
    assert rows["tools"]["within_2x"] > rows["kind"]["within_2x"] + 0.1
