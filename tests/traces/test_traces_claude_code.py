"""Claude Code transcripts: checked against the real sample files, read independently."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
from claude_code_newer import NEWER_COUNTS, NEWER_SUMMARY, SESSION_ID, newer_transcript

from mori.traces import GapKind, ProgramTrace, TraceError, TraceSet, read_traceset, write_traceset
from mori.traces.claude_code import iter_programs, looks_like_claude_code, read_session
from mori.traces.import_common import ImportOptions
from mori.traces.importers import detect_format
from mori.traces.loading import load_traces
from mori.traces.stats import wait_s

DATA = Path(__file__).resolve().parents[1] / "data" / "claude-code"
BIG = "ae4a77f8-aedd-4bc1-888f-c94edc91af04"
SESSIONS = ["short.jsonl", "tool_heavy.jsonl", "subagent.jsonl", f"{BIG}.jsonl"]


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _reference(lines: list[dict[str, object]]) -> dict[str, object]:
    """Per distinct requestId, in order: prompt, max output, request time (the last user
    line before its first line)."""
    order: list[str] = []
    prompt: dict[str, int] = {}
    output: dict[str, int] = {}
    start: dict[str, float] = {}
    last_user: float | None = None
    for obj in lines:
        if obj.get("type") == "user":
            last_user = _ts(str(obj["timestamp"]))
        if obj.get("type") != "assistant" or "requestId" not in obj:
            continue
        rid = str(obj["requestId"])
        usage = obj["message"]["usage"]  # type: ignore[index]
        if rid not in prompt:
            order.append(rid)
            prompt[rid] = (usage["input_tokens"] + usage["cache_creation_input_tokens"]
                           + usage["cache_read_input_tokens"])
            first = _ts(str(obj["timestamp"]))
            start[rid] = min(last_user, first) if last_user is not None else first
            output[rid] = 0
        output[rid] = max(output[rid], usage["output_tokens"])
    return {"ids": order, "prompt": prompt, "output": output, "start": start}


def _main_chain(file: Path) -> list[dict[str, object]]:
    out = []
    for raw in file.read_text().splitlines():
        obj = json.loads(raw)
        if obj.get("type") in ("user", "assistant") and not obj.get("isSidechain"):
            out.append(obj)
    return out


def _import(path: Path, **kw: bool) -> tuple[list[ProgramTrace], ImportOptions]:
    options = ImportOptions(**kw)
    return list(iter_programs([path], options)), options


@pytest.fixture(scope="module")
def folder() -> dict[str, ProgramTrace]:
    programs, _ = _import(DATA)
    return {p.name: p for p in programs}


def test_a_project_folder_at_once(folder: dict[str, ProgramTrace]) -> None:
    assert sorted(folder) == sorted(name.removesuffix(".jsonl") for name in SESSIONS)


@pytest.mark.parametrize("session", SESSIONS)
def test_steps_tokens_and_gaps_match_the_file(folder: dict[str, ProgramTrace],
                                              session: str) -> None:
    program = folder[session.removesuffix(".jsonl")]
    ref = _reference(_main_chain(DATA / session))
    ids = ref["ids"]
    assert isinstance(ids, list)
    assert len(program.steps) == len(ids) > 0
    prompts, outputs, starts = ref["prompt"], ref["output"], ref["start"]
    assert isinstance(prompts, dict) and isinstance(outputs, dict) and isinstance(starts, dict)
    assert [s.prompt_tokens for s in program.steps] == [prompts[i] for i in ids]
    assert sum(s.output_tokens for s in program.steps) == sum(outputs.values())
    for index, step in enumerate(program.steps):
        assert step.gap_s >= 0 and step.call_s is not None and step.call_s >= 0
        assert 0 <= step.reuse_tokens <= step.prompt_tokens
        if index + 1 < len(ids):
            # the gap (with any subagent wait) ends where the next request starts
            interval = starts[ids[index + 1]] - starts[ids[index]]
            assert step.call_s + wait_s(step) == pytest.approx(interval, abs=2e-3)
        else:
            assert step.gap_kind in (GapKind.END, GapKind.SUBAGENT) and step.gap_s == 0


def test_every_subagent_file_becomes_a_linked_program(folder: dict[str, ProgramTrace]) -> None:
    parent = folder[BIG]
    agent_files = sorted((DATA / BIG / "subagents").glob("agent-*.jsonl"))
    linked = {sp.program.name: (i, step) for i, step in enumerate(parent.steps)
              for sp in step.subagents}
    assert sorted(linked) == sorted(f"{BIG}/{f.stem.removeprefix('agent-')}"
                                    for f in agent_files)
    for file in agent_files:
        program = next(p for p in parent.all_programs()[1:]
                       if p.name == f"{BIG}/{file.stem.removeprefix('agent-')}")
        ref = _reference([json.loads(line) for line in file.read_text().splitlines()])
        assert len(program.steps) == len(ref["ids"])  # type: ignore[arg-type]
        assert sum(s.prompt_tokens for s in program.steps) == sum(ref["prompt"].values())  # type: ignore[attr-defined]
    index, step = linked[f"{BIG}/aac57f5"]
    assert step.gap_kind is GapKind.SUBAGENT and "Task" in step.tool_names
    # the compaction runs after the user's final answer: linked by time, the gap stays human
    index, step = linked[f"{BIG}/acompact-946d2b"]
    assert step.gap_kind is GapKind.HUMAN
    assert parent.steps[index + 1].prompt_tokens < step.prompt_tokens / 2  # context compacted


def test_subagent_rebuilt_from_progress_lines(folder: dict[str, ProgramTrace]) -> None:
    program = folder["subagent"]
    (spawn,) = [sp for s in program.steps for sp in s.subagents]
    assert spawn.program.name == "subagent/afb92ff"
    inner = [json.loads(line)["data"]["message"]
             for line in (DATA / "subagent.jsonl").read_text().splitlines()
             if '"agent_progress"' in line]
    ids = {m["requestId"] for m in inner if m.get("type") == "assistant"}
    assert len(spawn.program.steps) == len(ids) == 5


def test_human_gaps(folder: dict[str, ProgramTrace]) -> None:
    kinds = [s.gap_kind for s in folder["tool_heavy"].steps]
    assert kinds == [GapKind.TOOL, GapKind.HUMAN, GapKind.TOOL, GapKind.END]
    human = folder["tool_heavy"].steps[1]
    assert human.gap_s == pytest.approx(_ts("2026-02-10T22:59:22.893Z")
                                        - _ts("2026-02-10T22:58:02.888Z"), abs=1e-6)


def test_parallel_tool_calls_wait_for_the_longest(folder: dict[str, ProgramTrace]) -> None:
    step = folder["tool_heavy"].steps[2]  # WebSearch 6.48 s and Glob 0.24 s in parallel
    assert step.tool_names == ("WebSearch", "Glob")
    assert step.gap_s == pytest.approx(_ts("2026-02-10T22:59:33.333Z")
                                       - _ts("2026-02-10T22:59:26.854Z"), abs=1e-6)


def test_round_trip_is_lossless(folder: dict[str, ProgramTrace], tmp_path: Path) -> None:
    ts = TraceSet("claude-code", tuple(folder.values()))
    write_traceset(ts, tmp_path / "cc.jsonl.gz")
    assert read_traceset(tmp_path / "cc.jsonl.gz") == ts


def _with_line(tmp_path: Path, line: str, at: int) -> Path:
    lines = (DATA / "tool_heavy.jsonl").read_text().splitlines(keepends=True)
    lines.insert(at - 1, line + "\n")
    out = tmp_path / "tool_heavy.jsonl"
    out.write_text("".join(lines))
    return out


@pytest.mark.parametrize(("line", "problem"), [
    ('{"type": "user", "message": ', "invalid JSON"),
    ('["not", "an", "object"]', "not a JSON object"),
    ('{"type": "mystery", "x": 1}', "unknown line type 'mystery'"),
    ('{"type": "assistant", "requestId": "r", "timestamp": "2026-02-10T22:58:00Z"}',
     "missing field 'message'"),
    ('{"type": "user", "timestamp": "yesterday", "message": {"content": "hi"}}',
     "not an ISO-8601 timestamp"),
])
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, problem: str) -> None:
    bad = _with_line(tmp_path, line, 7)
    with pytest.raises(TraceError, match=rf"tool_heavy\.jsonl: line 7.*{problem}"):
        read_session(bad, ImportOptions(strict=True))  # strict: unknown types are bad too
    options = ImportOptions(skip_bad=True, strict=True)
    skipped = read_session(bad, options)
    assert options.report.bad_lines == 1 and problem in options.report.bad_examples[0]
    assert skipped is not None
    original = read_session(DATA / "tool_heavy.jsonl", ImportOptions())
    assert original is not None and skipped.steps == original.steps


def test_empty_session_is_left_out(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text('{"type": "summary", "summary": "x", "leafUuid": "u"}\n')
    shutil.copy(DATA / "short.jsonl", tmp_path / "short.jsonl")
    programs, options = _import(tmp_path)
    assert [p.name for p in programs] == ["short"]
    assert options.report.empty_sessions == 1


# -- newer Claude Code versions (2.1.15x): bookkeeping line types the importer does not know
#    (the transcript is built by claude_code_newer.newer_transcript)

def _clean_steps() -> tuple[object, ...]:
    program = read_session(DATA / "tool_heavy.jsonl", ImportOptions())
    assert program is not None
    return program.steps


def test_newer_line_types_are_skipped_and_counted(tmp_path: Path) -> None:
    file = newer_transcript(tmp_path)
    assert json.loads(file.read_text().splitlines()[0])["type"] == "permission-mode"
    programs, options = _import(tmp_path)
    (program,) = programs
    assert program.steps == _clean_steps()
    assert options.report.unknown_types == NEWER_COUNTS
    assert options.report.bad_lines == 0
    assert options.report.summary().endswith("; " + NEWER_SUMMARY)


def test_strict_refuses_unknown_types_naming_file_and_line(tmp_path: Path) -> None:
    file = newer_transcript(tmp_path)
    with pytest.raises(TraceError) as info:
        read_session(file, ImportOptions(strict=True))
    assert str(info.value).startswith(
        f"{file}: line 1: unknown line type 'permission-mode'; without --strict")
    options = ImportOptions(strict=True, skip_bad=True)  # strict + skip-bad: bad lines
    program = read_session(file, options)
    assert program is not None and program.steps == _clean_steps()
    assert options.report.bad_lines == 6 and not options.report.unknown_types
    assert "line 2: unknown line type 'mode'" in options.report.bad_examples[1]


def test_a_newer_transcript_is_detected(tmp_path: Path) -> None:
    file = newer_transcript(tmp_path / "proj")
    assert looks_like_claude_code(file) and looks_like_claude_code(file.parent)
    assert detect_format(file.parent) == "claude-code"
    assert load_traces(file.parent).programs[0].steps == _clean_steps()
    other = tmp_path / "other.jsonl"
    other.write_text('{"type": "mode", "mode": "normal"}\n{"type": "user", "uuid": "u"}\n')
    assert not looks_like_claude_code(other)  # an unknown first type needs a sessionId


def _sans_source(program: ProgramTrace) -> ProgramTrace:
    steps = tuple(replace(step, subagents=tuple(
        replace(spawn, program=_sans_source(spawn.program)) for spawn in step.subagents))
        for step in program.steps)
    return replace(program, source="", steps=steps)


def _strip_request_ids(value: object) -> object:
    if isinstance(value, dict):
        return {k: _strip_request_ids(v) for k, v in value.items() if k != "requestId"}
    if isinstance(value, list):
        return [_strip_request_ids(v) for v in value]
    return value


def test_without_request_id_steps_group_by_message_id(folder: dict[str, ProgramTrace],
                                                      tmp_path: Path) -> None:
    """A sanitised export (no requestId anywhere, progress-mirrored subagents included)
    gives the same programs as the original project folder."""
    for source in sorted(DATA.rglob("*.jsonl")):
        target = tmp_path / source.relative_to(DATA)
        target.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps(_strip_request_ids(json.loads(raw)))
                 for raw in source.read_text().splitlines()]
        target.write_text("\n".join(lines) + "\n")
        assert "requestId" not in target.read_text()
    programs, _ = _import(tmp_path)
    assert {p.name: _sans_source(p) for p in programs} == {
        name: _sans_source(p) for name, p in folder.items()}


def test_synthetic_message_is_not_a_call(tmp_path: Path) -> None:
    file = newer_transcript(tmp_path, strip_request_id=True)
    synthetic = {"type": "assistant", "sessionId": SESSION_ID, "isSidechain": False,
                 "timestamp": "2026-02-10T23:00:00.000Z", "uuid": "syn-1",
                 "message": {"id": "2f0f6a3c-7c1e-4b7e-9a51-0d3d2c9b8e11", "model": "<synthetic>",
                             "role": "assistant", "type": "message",
                             "usage": {"input_tokens": 0, "output_tokens": 0},
                             "content": [{"type": "text", "text": "No response requested."}]}}
    error = {**synthetic, "uuid": "syn-2", "isApiErrorMessage": True,
             "message": {**synthetic["message"], "id": "msg_err", "model": "claude-x"}}
    with file.open("a") as stream:
        stream.write(json.dumps(synthetic) + "\n" + json.dumps(error) + "\n")
    program = read_session(file, ImportOptions())
    assert program is not None and program.steps == _clean_steps()
