"""`mori trace import | stats | synth`, and `mori simulate --traces` on an imported format
or a shipped set's name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from claude_code_newer import NEWER_SUMMARY, newer_transcript

from mori.cli.main import main as mori_main
from mori.cli.trace_cmd import main
from mori.traces import default_traces, load_traces, read_traceset

DATA = Path(__file__).resolve().parents[1] / "data"


def test_import_then_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cc.jsonl.gz"
    assert main(["trace", "import", "claude-code", str(DATA / "claude-code"), "-o", str(out),
                 "--quiet"]) == 0
    ts = read_traceset(out)
    assert ts.name == "claude-code" and len(ts) == 4
    assert ts == load_traces(DATA / "claude-code")
    assert main(["trace", "stats", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["main"]["programs"] == 4 and data["subagents"]["programs"] == 3
    assert main(["trace", "stats", str(DATA / "codex"), "--threshold", "1",
                 "--plot", str(tmp_path / "figs")]) == 0
    text = capsys.readouterr().out
    assert "calls under 1 s: share of calls" in text
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
        "busy_phases_cdf.png", "context_growth.png", "tool_gaps_cdf.png"]


def test_import_bad_line_and_skip_bad(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "proj"
    src.mkdir()
    lines = (DATA / "claude-code" / "short.jsonl").read_text().splitlines(keepends=True)
    lines.insert(2, "garbage\n")
    (src / "short.jsonl").write_text("".join(lines))
    out = tmp_path / "o.jsonl"
    assert main(["trace", "import", "claude-code", str(src), "-o", str(out), "--quiet"]) == 2
    assert "short.jsonl: line 3: invalid JSON" in capsys.readouterr().err
    assert main(["trace", "import", "claude-code", str(src), "-o", str(out), "--skip-bad"]) == 0
    err = capsys.readouterr().err
    assert "1 bad line(s) skipped" in err and "line 3" in err
    assert len(read_traceset(out)) == 1


def test_synth_then_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.jsonl"
    assert main(["trace", "synth", "--programs", "20", "--seed", "3", "-o", str(out)]) == 0
    assert main(["trace", "stats", str(out), "--json"]) == 0
    main_stats = json.loads(capsys.readouterr().out)["main"]
    assert main_stats["short_calls_frac"] == pytest.approx(0.87, abs=0.01)
    assert main_stats["short_time_frac"] == pytest.approx(0.42, abs=0.01)
    assert main(["trace", "synth", "--programs", "0", "-o", str(out)]) == 2
    assert "programs must be at least 1" in capsys.readouterr().err


def test_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["trace"]) == 2
    assert main(["trace", "import", "nope", "x", "-o", "y"]) == 2
    assert main(["trace", "stats", str(tmp_path / "absent.jsonl")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_simulate_reads_an_importable_format(capsys: pytest.CaptureFixture[str]) -> None:
    code = mori_main(["simulate", "--traces", str(DATA / "codex"), "--policy", "mori",
                      "--programs", "2", "--duration", "120", "--quiet"])
    assert code == 0
    assert "mori" in capsys.readouterr().out


def test_import_newer_transcript_counts_unknown_types(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = newer_transcript(tmp_path / "proj")
    clean, out = tmp_path / "clean.jsonl", tmp_path / "new.jsonl"
    shutil.copytree(tmp_path / "proj", tmp_path / "clean")
    shutil.copy(DATA / "claude-code" / "tool_heavy.jsonl", tmp_path / "clean" / file.name)
    assert main(["trace", "import", "claude-code", str(tmp_path / "clean"), "-o", str(clean),
                 "--quiet"]) == 0
    assert main(["trace", "import", "claude-code", str(file.parent), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"; {NEWER_SUMMARY}\n" in err
    assert read_traceset(out).programs[0].steps == read_traceset(clean).programs[0].steps
    assert main(["trace", "import", "claude-code", str(file.parent), "-o", str(out),
                 "--strict"]) == 2
    err = capsys.readouterr().err
    assert f"{file}: line 1: unknown line type 'permission-mode'" in err
    assert not out.exists()  # no partial output


def test_stats_of_a_shipped_set_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["trace", "stats", "kv-cache-tester-31", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["main"]["programs"] == len(default_traces()) == 31
    assert main(["trace", "stats", "kv-cache-tester-3"]) == 2
    err = capsys.readouterr().err
    assert "kv-cache-tester-3: no such file or directory" in err
    assert "name of a shipped trace set: kv-cache-tester-31" in err
    shutil.copytree(DATA / "kv-cache-tester", tmp_path / "kv-cache-tester-31")
    assert main(["trace", "stats", "kv-cache-tester-31", "--json"]) == 0  # a path wins
    assert json.loads(capsys.readouterr().out)["main"]["programs"] == 3
