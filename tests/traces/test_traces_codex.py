"""Codex CLI rollouts: the hand-written fixture, read independently."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from mori.traces import GapKind, TraceError, TraceSet, read_traceset, write_traceset
from mori.traces.codex import iter_programs, read_rollout
from mori.traces.import_common import ImportOptions

DATA = Path(__file__).resolve().parents[1] / "data" / "codex"
FILE = next(DATA.glob("rollout-*.jsonl"))


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _lines() -> list[dict[str, object]]:
    return [json.loads(line) for line in FILE.read_text().splitlines()]


def _program():  # type: ignore[no-untyped-def]
    program = read_rollout(FILE, ImportOptions())
    assert program is not None
    return program


def test_one_step_per_distinct_token_count() -> None:
    counts = [o["payload"]["info"] for o in _lines()  # type: ignore[index]
              if o["type"] == "event_msg" and o["payload"]["type"] == "token_count"  # type: ignore[index]
              and o["payload"]["info"] is not None]  # type: ignore[index]
    distinct = []
    for info in counts:
        if not distinct or info["total_token_usage"] != distinct[-1]["total_token_usage"]:
            distinct.append(info)
    program = _program()
    assert program.name == "0199a1f2-3c4d-7e5f-8a9b-0c1d2e3f4a5b"
    assert len(program.steps) == len(distinct) == 9
    total = distinct[-1]["total_token_usage"]
    assert sum(s.prompt_tokens for s in program.steps) == total["input_tokens"]
    assert sum(s.output_tokens for s in program.steps) == total["output_tokens"]
    assert sum(s.reuse_tokens for s in program.steps) == total["cached_input_tokens"]
    assert all(s.new_tokens == s.prompt_tokens - s.reuse_tokens for s in program.steps)


def test_tool_gaps_human_gap_and_timeline() -> None:
    steps = _program().steps
    assert [s.gap_kind for s in steps] == [GapKind.TOOL] * 4 + [GapKind.HUMAN] + \
        [GapKind.TOOL] * 3 + [GapKind.END]
    assert steps[0].tool_names == ("shell",) and steps[2].tool_names == ("apply_patch",)
    # pytest ran from 10:15:09.410 to 10:15:13.020
    assert steps[0].gap_s == pytest.approx(3.61, abs=1e-6)
    # two parallel calls: 0.145 s and 0.290 s -> the longest
    assert steps[1].gap_s == pytest.approx(0.29, abs=1e-6)
    # final answer at 10:15:30.450, next prompt at 10:17:12.301
    assert steps[4].gap_s == pytest.approx(101.851, abs=1e-6)
    # requests: the prompt, then each last tool output or prompt; call + gap spans them
    starts = [_ts("2025-11-04T10:15:05.121Z"), _ts("2025-11-04T10:15:13.020Z")]
    assert steps[0].call_s + steps[0].gap_s == pytest.approx(starts[1] - starts[0], abs=1e-6)
    assert all(s.gap_s >= 0 and s.call_s is not None and s.call_s >= 0 for s in steps)


def test_round_trip(tmp_path: Path) -> None:
    ts = TraceSet("codex", tuple(iter_programs([DATA], ImportOptions())))
    write_traceset(ts, tmp_path / "c.jsonl")
    assert read_traceset(tmp_path / "c.jsonl") == ts


def test_bad_lines(tmp_path: Path) -> None:
    lines = FILE.read_text().splitlines(keepends=True)
    lines.insert(3, '{"timestamp": "2025-11-04T10:15:05.000Z", "type": "weird", "payload": {}}\n')
    lines.insert(5, "{oops\n")
    bad = tmp_path / FILE.name
    bad.write_text("".join(lines))
    with pytest.raises(TraceError, match=r"rollout-.*\.jsonl: line 4: unknown line type 'weird'"):
        read_rollout(bad, ImportOptions())
    options = ImportOptions(skip_bad=True)
    program = read_rollout(bad, options)
    assert options.report.bad_lines == 2
    assert program is not None and program.steps == _program().steps
