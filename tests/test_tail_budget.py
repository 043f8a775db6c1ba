"""scripts/tail_budget.py: the arithmetic of the tail estimate, on hand-made runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mori.core.costmodel import CostModel, get_preset

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tail_budget.py"
PRESET = "h200-qwen3-30b-a3b"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tail_budget", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(**over: Any) -> dict[str, Any]:
    r = {"policy": "mori", "hardware": PRESET, "cpu_ratio": 1.0, "replicas": 1,
         "programs_per_replica": 80, "duration_s": 3600, "requests_waiting_at_end": 50,
         "demotions_to_none": 400, "recomputed_tokens": 20_000_000, "ttft_p90_s": 40.0,
         "wait_max_at_end_s": 3000.0}
    r.update(over)
    return r


def test_the_estimate_by_hand() -> None:
    rate = CostModel(get_preset(PRESET)).prefill_rate()
    (row,) = load().rows([run()], 4.0)
    # bound 160 s: 50 parked readmitted every 160 s = 1,125 an hour, 725 beyond the 400
    # drops, each recomputing 50,000 tokens (20 M over 400 drops)
    assert row[4:9] == ("50", "400", f"{100 * 20e6 / rate / 3600:.1f}", "160", "1125")
    assert row[9] == f"{100 * 725 * 50_000 / rate / 3600:.1f}"
    # twice the replicas: twice the prefill rate, half the share
    (two,) = load().rows([run(replicas=2)], 4.0)
    assert float(two[9]) == pytest.approx(float(row[9]) / 2, abs=0.06)


def test_runs_with_nothing_past_the_bound_are_left_out() -> None:
    mod = load()
    assert mod.rows([run(wait_max_at_end_s=150.0)], 4.0) == []  # under 4 x 40 s
    assert len(mod.rows([run(wait_max_at_end_s=150.0)], 3.0)) == 1  # over 3 x 40 s
    assert mod.rows([run(demotions_to_none=0)], 4.0) == []
    assert mod.rows([run(policy="thunderagent+offload")], 4.0) == []


def test_main_reads_a_sweep_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"runs": [run(), run(policy="smg")]}))
    load().main([str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| preset |") and len(lines) == 3
    assert lines[2].startswith(f"| {PRESET} | 1x | 1 | 80 | 50 |")


@pytest.mark.parametrize(("content", "says"), [
    (None, "cannot read"),
    ("{bad", "not JSON (line 1"),
    ('{"runs": 3}', "expected a sweep.json"),
    ('[{"policy": "mori", "hardware": "h200-qwen3-30b-a3b"}]', "lack cpu_ratio"),
])
def test_bad_files_get_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      content: str | None, says: str) -> None:
    path = tmp_path / "sweep.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        load().main([str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
