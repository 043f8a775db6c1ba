"""The TraceLab importer: both providers, sanitized and private rows, subagents, odd rows,
streaming, and the DuckDB database."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from tests.traces.tracelab_rows import (
    claude_session,
    codex_session,
    row,
    tool,
    write_db,
    write_rows,
)

from mori.traces.errors import TraceError
from mori.traces.import_common import ImportOptions
from mori.traces.importers import IMPORTERS, detect_format
from mori.traces.loading import load_traces
from mori.traces.model import GapKind, ProgramTrace
from mori.traces.tracelab import iter_programs


def _import(path: Path, **kw: object) -> tuple[list[ProgramTrace], ImportOptions]:
    options = ImportOptions(**kw)  # type: ignore[arg-type]
    return list(iter_programs([path], options)), options


def test_both_providers_become_programs_with_their_steps(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", claude_session() + codex_session())
    programs, options = _import(path)
    assert [(p.name, p.provider) for p in programs] == [("claude:s1", "claude"),
                                                        ("codex:c1", "codex")]
    claude, codex = programs
    first, second, last = claude.steps
    # the Bash call ran 4.9 s by its internal latency: the gap; the rest is the call
    assert (first.gap_kind, first.gap_s, first.call_s) == (GapKind.TOOL, 4.9, 4.1)
    assert first.tool_names == ("Bash",)
    assert (first.prompt_tokens, first.reuse_tokens, first.new_tokens) == (20_000, 0, 5_000)
    # a person typed the next prompt 30 s after the second response ended
    assert (second.gap_kind, second.gap_s, second.call_s) == (GapKind.HUMAN, 30.0, 3.0)
    assert (second.reuse_tokens, second.new_tokens) == (20_000, 1_000)
    assert (last.gap_kind, last.call_s) == (GapKind.END, 3.0)
    assert claude.shared_prefix_tokens == 15_000
    # Codex: null Claude fields; the internal latency (0 ms) wins over the wall one
    step = codex.steps[0]
    assert (step.prompt_tokens, step.new_tokens, step.gap_s, step.call_s) == (9_000, 3_000,
                                                                             0.0, 2.5)
    assert options.report.programs == 2 and options.report.steps == 5
    assert not options.report.ignored


def test_format_is_detected_and_loads_for_simulation(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "rounds.jsonl.gz", claude_session() + codex_session())
    assert detect_format(path) == "tracelab"
    assert detect_format(tmp_path) == "tracelab"
    ts = load_traces(path)
    assert ts.name == "rounds" and {p.provider for p in ts.programs} == {"claude", "codex"}


def test_private_rows_nest_subagents_in_their_parent(tmp_path: Path) -> None:
    parent = [
        row("claude", "claude:p", 0, inputs=[("user_message", 0.0)],
            outputs=[("tool_call", 5.0)], prompt=30_000, prefix=0, private=True,
            tools=[tool("Task", 5.0, 60_000, private=True)]),
        row("claude", "claude:p", 1, inputs=[("tool_result", 65.0)],
            outputs=[("text", 70.0)], prompt=31_000, prefix=30_000, private=True),
    ]
    agent = [
        row("claude", "claude:p/subagents/agent-a1", 0, inputs=[("user_message", 6.0)],
            outputs=[("tool_call", 8.0)], prompt=5_000, prefix=0, private=True,
            tools=[tool("Read", 8.0, 100, private=True)]),
        row("claude", "claude:p/subagents/agent-a1", 1, inputs=[("tool_result", 8.1)],
            outputs=[("text", 20.0)], prompt=6_000, prefix=5_000, private=True),
    ]
    compaction = [
        row("claude", "claude:p/subagents/agent-acompact-1", 0,
            inputs=[("user_message", 66.0)], outputs=[("text", 68.0)], prompt=1_000,
            prefix=0, private=True),
    ]
    # rows of the subagents come before and after the parent's: the file order is free
    path = write_rows(tmp_path / "t.jsonl", agent + parent[:1] + compaction + parent[1:])
    programs, options = _import(path)
    assert [p.name for p in programs] == ["claude:p"]
    (top,) = programs
    waited = top.steps[0]
    assert waited.gap_kind is GapKind.SUBAGENT
    assert [s.program.name for s in waited.subagents] == ["claude:p/subagents/agent-a1"]
    assert waited.subagents[0].delay_s == pytest.approx(1.0)
    later = top.steps[1]  # the compaction began during the second call: not waited on
    assert [s.program.name for s in later.subagents] == ["claude:p/subagents/agent-acompact-1"]
    assert options.report.subagents == 2 and options.report.steps == 5
    assert not options.report.ignored  # private fields (session_file, home, input) are known


def test_rounds_out_of_order_and_sessions_interleaved_import_alike(tmp_path: Path) -> None:
    rows = claude_session() + codex_session() + claude_session("claude:s2")
    ordered, _ = _import(write_rows(tmp_path / "a.jsonl", rows))
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    assert shuffled != rows
    mixed, _ = _import(write_rows(tmp_path / "b.jsonl", shuffled))
    by_name = {p.name: p.steps for p in mixed}
    assert {p.name: p.steps for p in ordered} == by_name


def test_missing_latencies_fall_back_to_wall_then_result_then_next_request(
        tmp_path: Path) -> None:
    def session(name: str, tool_row: dict[str, object]) -> list[dict[str, object]]:
        return [
            row("codex", name, 0, inputs=[("user_message", 0.0)],
                outputs=[("tool_call", 1.0)], prompt=1_000, prefix=0, tools=[tool_row]),
            row("codex", name, 1, inputs=[("tool_result", 11.0)],
                outputs=[("text", 12.0)], prompt=1_500, prefix=1_000),
        ]
    no_times = tool("exec_command", 1.0, None)
    no_times["emitted_at"] = None
    rows = (session("codex:wall", tool("exec_command", 1.0, 3000))
            + session("codex:result", {**tool("exec_command", 1.0, 7000),
                                       "tool_wall_latency_ms": None})
            + session("codex:none", no_times))
    programs, _ = _import(write_rows(tmp_path / "t.jsonl", rows))
    gaps = {p.name: p.steps[0].gap_s for p in programs}
    # wall 3 s; no latency but a result 7 s after the call; nothing: response end to
    # the next request (10 s)
    assert gaps == {"codex:wall": 3.0, "codex:result": 7.0, "codex:none": 10.0}


def test_a_round_without_timestamps_is_placed_and_noted(tmp_path: Path) -> None:
    rows = claude_session()
    rows[1] = {**rows[1], "timing_events": []}
    programs, options = _import(write_rows(tmp_path / "t.jsonl", rows))
    assert len(programs[0].steps) == 3
    assert any("1 round(s) without any timestamp" in note for note in options.report.notes)


def test_torn_last_line_names_file_and_line_or_is_skipped(tmp_path: Path) -> None:
    rows = claude_session()
    path = write_rows(tmp_path / "t.jsonl", rows,
                      tail='{"provider": "claude", "session_id": "claude:s1", "round_in')
    with pytest.raises(TraceError, match=r"t\.jsonl: line 4: invalid JSON"):
        _import(path)
    programs, options = _import(path, skip_bad=True)
    assert len(programs) == 1 and len(programs[0].steps) == 3
    assert options.report.bad_lines == 1


def test_bad_field_names_line_and_field_and_skipping_keeps_the_rest(tmp_path: Path) -> None:
    rows = claude_session() + codex_session()
    rows[3] = {**rows[3], "round_index": "first"}
    path = write_rows(tmp_path / "t.jsonl", rows)
    with pytest.raises(TraceError, match=r"line 4: round_index: expected a non-negative "
                                         r"integer, got string"):
        _import(path)
    programs, options = _import(path, skip_bad=True)
    assert [len(p.steps) for p in programs] == [3, 1]
    assert options.report.bad_lines == 1


def test_unknown_fields_and_event_types_are_counted_or_refused(tmp_path: Path) -> None:
    rows = claude_session()
    rows[0] = {**rows[0], "cost_usd": 0.1}
    rows[1]["timing_events"].append({"event_type": "compaction", "timestamp": None,
                                     "source": "x"})
    rows[1]["tools"] = [{**tool("Read", 12.0, 5), "mcp_server": "fs"}]
    path = write_rows(tmp_path / "t.jsonl", rows)
    programs, options = _import(path)
    assert len(programs[0].steps) == 3
    assert options.report.ignored == {"field 'cost_usd'": 1, "event type 'compaction'": 1,
                                      "field 'mcp_server'": 1}
    assert "ignored unknown parts: event type 'compaction' 1" in options.report.summary()
    with pytest.raises(TraceError, match=r"line 1: cost_usd: unknown field 'cost_usd'"):
        _import(path, strict=True)


def test_repeated_rounds_are_left_out_and_noted(tmp_path: Path) -> None:
    rows = claude_session()
    programs, options = _import(write_rows(tmp_path / "t.jsonl", rows + rows[1:2]))
    assert len(programs[0].steps) == 3
    assert any("1 repeated round(s)" in note for note in options.report.notes)


def test_programs_stream_out_as_their_sessions_end(tmp_path: Path) -> None:
    rows = [r for i in range(40) for r in claude_session(f"claude:s{i:02d}")]
    options = ImportOptions()
    stream = iter_programs([write_rows(tmp_path / "t.jsonl", rows)], options)
    first = next(stream)
    # the first session's three rows were read, not the file's 120
    assert first.name == "claude:s00" and options.report.lines == 3
    assert len(list(stream)) == 39


def test_duckdb_database_imports_like_the_jsonl(tmp_path: Path) -> None:
    rows = codex_session() + claude_session() + claude_session("claude:s2")
    rows[0]["tools"][0]["tool_internal_latency_ms"] = None  # wall latency then: 0.5 s
    from_jsonl, _ = _import(write_rows(tmp_path / "t.jsonl", rows))
    db = write_db(tmp_path / "syfi_coding_trace.duckdb", rows)
    assert detect_format(db) == "tracelab"
    from_db, options = _import(db)
    assert sorted((p.name, p.provider, p.steps) for p in from_db) == sorted(
        (p.name, p.provider, p.steps) for p in from_jsonl)
    assert options.report.lines == len(rows) and options.report.programs == 3
    assert load_traces(db).name == "syfi_coding_trace"


def test_duckdb_errors_say_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    import duckdb

    other = tmp_path / "other.duckdb"
    con = duckdb.connect(str(other))
    con.execute("CREATE TABLE rounds (x INTEGER)")
    con.close()
    with pytest.raises(TraceError, match="not a TraceLab database: no table 'tool_calls'"):
        _import(other)
    db = write_db(tmp_path / "t.duckdb", claude_session())
    monkeypatch.setitem(sys.modules, "duckdb", None)
    with pytest.raises(TraceError, match=r"pip install 'mori\[tracelab\]'"):
        _import(db)


def test_registered_for_trace_import() -> None:
    assert "tracelab" in IMPORTERS.names()


def test_cli_imports_and_simulate_runs_on_the_rows(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from mori.cli.main import main

    rows = [r for i in range(3) for r in claude_session(f"claude:s{i}") + codex_session(
        f"codex:c{i}")]
    src = write_rows(tmp_path / "syfi.jsonl.gz", rows)
    out = tmp_path / "syfi.mori.jsonl.gz"
    assert main(["trace", "import", "tracelab", str(src), "-o", str(out), "--quiet"]) == 0
    assert {p.provider for p in load_traces(out).programs} == {"claude", "codex"}
    result = tmp_path / "sim.json"
    assert main(["simulate", "--traces", str(src), "--duration", "300", "--programs", "4",
                 "--policy", "mori", "--quiet", "--json", str(result)]) == 0
    (run,) = json.loads(result.read_text())
    assert run["steps"] > 0 and run["programs_started"] >= 4
    capsys.readouterr()


REAL = Path(__file__).resolve().parents[1] / "data" / "tracelab"


def test_real_example_rows_sanitized_and_private_import_alike() -> None:
    """TraceLab's own example sessions (tests/data/tracelab/NOTICE.md): one Claude Code
    and one Codex session, in the public (sanitized) and the private (derived) form."""
    public, p_opts = _import(REAL / "sanitized_round_trace.jsonl", strict=True)
    private, q_opts = _import(REAL / "derived_round_trace.jsonl", strict=True)
    assert [(p.provider, len(p.steps)) for p in public] == [("claude", 10), ("codex", 9)]
    # the two forms differ only in ids and in the private fields: the same steps
    assert [p.steps for p in public] == [p.steps for p in private]
    assert not p_opts.report.ignored and not q_opts.report.ignored
    claude, codex = public
    # the Claude session's first round: a prompt at 05:40:20.151, the response's last
    # tool_use at 05:40:31.647, a WebSearch of 19.287 s (internal), the next request at
    # the last tool result, 05:40:50.938
    first = claude.steps[0]
    assert first.tool_names == ("Bash", "WebSearch")
    assert (first.gap_kind, first.gap_s, first.call_s) == (GapKind.TOOL, 19.287, 11.5)
    assert (first.prompt_tokens, first.new_tokens) == (32_272, 5_055)
    # a person typed the sixth round's prompt after the fifth's final answer
    assert [s.gap_kind for s in claude.steps].count(GapKind.HUMAN) == 1
    assert claude.steps[4].gap_kind is GapKind.HUMAN
    assert claude.steps[4].gap_s == pytest.approx(19.913)
    assert {s.gap_kind for s in codex.steps} <= {GapKind.TOOL, GapKind.HUMAN, GapKind.END}


def test_progress_counts_the_bytes_on_disk_of_a_gzipped_file(tmp_path: Path) -> None:
    rows = [r for i in range(30) for r in claude_session(f"claude:s{i}")]
    path = write_rows(tmp_path / "t.jsonl.gz", rows)
    seen: list[int] = []
    programs, _ = _import(path, progress=seen.append)
    assert len(programs) == 30
    # the progress bar is sized by the file on disk: its updates add up to that, not to
    # the decompressed bytes (several times more)
    assert sum(seen) == path.stat().st_size


def test_a_line_nested_too_deep_is_a_bad_line_not_a_crash(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "t.jsonl", claude_session(),
                      tail="[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(TraceError, match=r"t\.jsonl: line 4: invalid JSON"):
        _import(path)
    programs, options = _import(path, skip_bad=True)
    assert len(programs) == 1 and options.report.bad_lines == 1
