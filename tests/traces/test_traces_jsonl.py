"""Canonical JSONL trace files: lossless round trip and located errors."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.traces import (
    GapKind,
    ProgramTrace,
    Step,
    SubagentSpawn,
    TraceError,
    TraceSet,
    load_kvcache_tester_dir,
    read_traceset,
    write_traceset,
)
from mori.traces.jsonl import TraceWriter, iter_programs

DATA = Path(__file__).resolve().parents[1] / "data" / "kv-cache-tester"


def _leaf(name: str, gap: float) -> ProgramTrace:
    steps = (
        Step(100, 7, gap, GapKind.TOOL, 0),
        Step(250, 3, 0.0, GapKind.END, 192),
    )
    return ProgramTrace(name=name, steps=steps, shared_prefix_tokens=0, source="")


def _with_subagents() -> ProgramTrace:
    middle = ProgramTrace(
        name="root/mid",
        steps=(
            Step(
                40, 2, 1e-300, GapKind.SUBAGENT, 0, (SubagentSpawn(0.1, _leaf("root/mid/x", 2.5)),)
            ),
            Step(90, 1, 0.0, GapKind.END, 40),
        ),
        source="synthetic",
    )
    spawns = (SubagentSpawn(0.0, middle), SubagentSpawn(123456.789, _leaf("root/b", 1 / 3)))
    return ProgramTrace(
        name="root \u00e9\u6f22",
        steps=(
            Step(1000, 50, 4.25, GapKind.SUBAGENT, 0, spawns),
            Step(1100, 60, 7.0, GapKind.HUMAN, 1000),
            Step(1200, 0, 0.0, GapKind.END, 1100),
        ),
        shared_prefix_tokens=512,
        source="/some/where.json",
    )


def _sample_set() -> TraceSet:
    real = load_kvcache_tester_dir(DATA).programs
    return TraceSet(name="sample", programs=(*real, _with_subagents(), ProgramTrace("empty", ())))


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_round_trip_is_lossless(tmp_path: Path, suffix: str) -> None:
    ts = _sample_set()
    path = tmp_path / f"set{suffix}"
    write_traceset(ts, path)
    back = read_traceset(path)
    assert back == ts
    assert back.programs[3].all_programs() == ts.programs[3].all_programs()
    assert all(isinstance(s.gap_kind, GapKind) for p in back.programs for s in p.steps)
    assert read_traceset(str(path)) == ts


def test_layout_and_determinism(tmp_path: Path) -> None:
    ts = _sample_set()
    gz, gz2, plain = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz", tmp_path / "a.jsonl"
    write_traceset(ts, gz)
    write_traceset(ts, gz2)
    write_traceset(ts, plain)
    assert gz.read_bytes()[:2] == b"\x1f\x8b"
    assert gz.read_bytes() == gz2.read_bytes()
    assert gzip.decompress(gz.read_bytes()) == plain.read_bytes()
    lines = plain.read_text(encoding="utf-8").splitlines()
    assert json.loads(lines[0]) == {"format": "mori-trace", "version": 2, "name": "sample"}
    assert len(lines) == 1 + len(ts)
    first = json.loads(lines[1])
    # kv-cache-tester records Claude Code sessions: its programs carry their provider
    assert list(first) == ["name", "source", "shared_prefix_tokens", "provider", "steps"]
    assert first["provider"] == "claude"
    assert list(first["steps"][0]) == [
        "prompt_tokens",
        "output_tokens",
        "gap_s",
        "gap_kind",
        "reuse_tokens",
        "call_s",  # kv-cache-tester's api_time; unknown fields are left out
    ]
    root = json.loads(lines[4])
    assert [s.get("subagents") is not None for s in root["steps"]] == [True, False, False]
    assert root["steps"][0]["subagents"][0]["program"]["name"] == "root/mid"


def test_reader_defaults_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "hand.jsonl"
    header = '{"format": "mori-trace", "version": 1, "name": "hand"}'
    program = '{"name": "p", "steps": [{"prompt_tokens": 5, "output_tokens": 1, "gap_s": 0,'
    program += ' "gap_kind": "end", "extra": 1}]}'
    path.write_text(f"{header}\n\n{program}\n\n")
    ts = read_traceset(path)
    assert ts == TraceSet("hand", (ProgramTrace("p", (Step(5, 1, 0.0, GapKind.END),)),))


def test_write_non_finite_is_trace_error(tmp_path: Path) -> None:
    bad = ProgramTrace("nan", (Step(1, 1, math.inf, GapKind.TOOL), Step(1, 1, 0.0, GapKind.END)))
    with pytest.raises(TraceError, match=r"out\.jsonl: programs\[0\] \('nan'\): cannot write"):
        write_traceset(TraceSet("s", (bad,)), tmp_path / "out.jsonl")


HEADER = '{"format":"mori-trace","version":1,"name":"s"}'
STEP = '{"prompt_tokens":10,"output_tokens":1,"gap_s":1.5,"gap_kind":"tool","reuse_tokens":0}'


def _prog(step: str = STEP, extra: str = "") -> str:
    return '{"name":"p","source":"","shared_prefix_tokens":0,"steps":[' + step + "]" + extra + "}"


BAD_FILES = [
    ("", "f.jsonl: line 1: empty file"),
    ("[]\n", "f.jsonl: line 1: expected a JSON object, got array"),
    ('{"name": "s"}\n', "f.jsonl: line 1: not a header"),
    ('{"format":"other","version":1,"name":"s"}\n', "line 1: not a header"),
    ('{"format":"mori-trace","version":3,"name":"s"}\n', "line 1: version: unsupported version 3; this reader knows versions 1 and 2"),
    ('{"format":"mori-trace","version":1}\n', "f.jsonl: line 1: missing field 'name'"),
    ("not json\n", "f.jsonl: line 1, column 1: invalid JSON"),
    (f"{HEADER}\n{_prog()}\n{{oops\n", "f.jsonl: line 3, column 2: invalid JSON"),
    (f"{HEADER}\n[1]\n", "f.jsonl: line 2: expected a JSON object, got array"),
    (f"{HEADER}\n" + '{"steps":[]}\n', "f.jsonl: line 2: missing field 'name'"),
    (f"{HEADER}\n" + '{"name":"p"}\n', "f.jsonl: line 2: missing field 'steps'"),
    (f"{HEADER}\n" + _prog(STEP.replace('"gap_s":1.5,', "")), "line 2: steps[0]: missing field 'gap_s'"),
    (f"{HEADER}\n" + _prog(STEP.replace("1.5", '"1.5"')), "line 2: steps[0].gap_s: expected a non-negative number"),
    (f"{HEADER}\n" + _prog(STEP.replace("1.5", "-1.5")), "line 2: steps[0].gap_s: must not be negative"),
    (f"{HEADER}\n" + _prog(STEP.replace("1.5", "NaN")), "line 2: steps[0].gap_s: must be finite"),
    (f"{HEADER}\n" + _prog(STEP.replace('"tool"', '"nap"')), "line 2: steps[0].gap_kind: unknown gap kind 'nap'"),
    (f"{HEADER}\n" + _prog(STEP.replace('"reuse_tokens":0', '"reuse_tokens":11')), "line 2: steps[0].reuse_tokens: reuse_tokens 11 exceeds"),
    (f"{HEADER}\n" + _prog(STEP.replace("10", "-10")), "line 2: steps[0].prompt_tokens: must not be negative"),
    (f"{HEADER}\n" + _prog(extra=',"shared_prefix_tokens":1.5'), "line 2: shared_prefix_tokens: expected a non-negative integer"),
    (f"{HEADER}\n" + _prog(STEP[:-1] + ',"subagents":[{"delay_s":1}]}'), "line 2: steps[0].subagents[0]: missing field 'program'"),
    (f"{HEADER}\n" + _prog(STEP[:-1] + ',"new_tokens":11}'), "line 2: steps[0].new_tokens: new_tokens 11 exceeds prompt_tokens 10"),
    (f"{HEADER}\n" + _prog(STEP[:-1] + ',"call_s":-1}'), "line 2: steps[0].call_s: must not be negative"),
    (f"{HEADER}\n" + _prog(STEP[:-1] + ',"tool_names":["Read",3]}'), "line 2: steps[0].tool_names[1]: expected a string"),
    (f"{HEADER}\n" + _prog(STEP[:-1] + ',"block_hashes":[1,"x"]}'), "line 2: steps[0].block_hashes[1]: expected an integer"),
    (
        f"{HEADER}\n{_prog()}\n"
        + _prog(STEP[:-1] + ',"subagents":[{"delay_s":1,"program":' + _prog('{"gap_s":1}') + "}]}"),
        "f.jsonl: line 3: steps[0].subagents[0].program.steps[0]: missing field 'prompt_tokens'",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BAD_FILES)
def test_bad_file_names_file_line_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "f.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(TraceError) as info:
        read_traceset(path)
    assert message in str(info.value)
    assert str(info.value).startswith(str(path))


def test_bad_bytes(tmp_path: Path) -> None:
    not_gz = tmp_path / "f.jsonl.gz"
    not_gz.write_text(HEADER + "\n")
    with pytest.raises(TraceError, match=r"f\.jsonl\.gz: line 1: cannot read: .*gzip"):
        read_traceset(not_gz)
    truncated = tmp_path / "t.jsonl.gz"
    truncated.write_bytes(gzip.compress((HEADER + "\n" + _prog() + "\n").encode())[:-12])
    with pytest.raises(TraceError, match=r"t\.jsonl\.gz: .*cannot read"):
        read_traceset(truncated)
    latin = tmp_path / "l.jsonl"
    latin.write_bytes(HEADER.encode() + b"\n" + b'{"name":"\xe9"}\n')
    with pytest.raises(TraceError, match=r"l\.jsonl: line 2: not UTF-8"):
        read_traceset(latin)
    with pytest.raises(TraceError, match=r"missing\.jsonl: cannot read"):
        read_traceset(tmp_path / "missing.jsonl")


def test_version_1_files_still_read(tmp_path: Path) -> None:
    path = tmp_path / "v1.jsonl"
    path.write_text(f"{HEADER}\n{_prog()}\n")
    (program,) = read_traceset(path).programs
    assert program.steps == (Step(10, 1, 1.5, GapKind.TOOL, 0),)
    assert program.steps[0].call_s is None and program.steps[0].tool_names == ()
    assert program.block_size is None


def test_streaming_writer_and_reader(tmp_path: Path) -> None:
    ts = _sample_set()
    path = tmp_path / "s.jsonl.gz"
    with TraceWriter(path, ts.name) as writer:
        for program in ts.programs:
            writer.write(program)
    assert writer.count == len(ts)
    assert tuple(iter_programs(path)) == ts.programs
    assert read_traceset(path) == ts


_names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
_times = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)


@st.composite
def _steps(draw: st.DrawFn) -> Step:
    prompt = draw(st.integers(0, 10**6))
    return Step(
        prompt_tokens=prompt,
        output_tokens=draw(st.integers(0, 10**5)),
        gap_s=draw(_times),
        gap_kind=draw(st.sampled_from(list(GapKind))),
        reuse_tokens=draw(st.integers(0, prompt)),
        new_tokens=draw(st.none() | st.integers(0, prompt)),
        call_s=draw(st.none() | _times),
        tool_names=tuple(draw(st.lists(_names, max_size=3))),
        block_hashes=draw(st.none() | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=5)
                          .map(tuple)),
    )


@st.composite
def _programs(draw: st.DrawFn, depth: int = 0) -> ProgramTrace:
    steps = draw(st.lists(_steps(), min_size=1, max_size=4))
    if depth < 1 and draw(st.booleans()):
        sub = draw(_programs(depth + 1))
        first = steps[0]
        steps[0] = Step(first.prompt_tokens, first.output_tokens, first.gap_s,
                        GapKind.SUBAGENT, first.reuse_tokens, (SubagentSpawn(draw(_times), sub),),
                        first.new_tokens, first.call_s, first.tool_names, first.block_hashes)
    has_hashes = any(s.block_hashes is not None for s in steps)
    return ProgramTrace(
        name=draw(_names), steps=tuple(steps), shared_prefix_tokens=draw(st.integers(0, 10**5)),
        source=draw(_names), block_size=draw(st.integers(1, 256)) if has_hashes else None)


@settings(max_examples=40, deadline=None)
@given(st.lists(_programs(), max_size=3), _names)
def test_round_trip_property(tmp_path_factory: pytest.TempPathFactory,
                             programs: list[ProgramTrace], name: str) -> None:
    ts = TraceSet(name, tuple(programs))
    path = tmp_path_factory.mktemp("rt") / "p.jsonl.gz"
    write_traceset(ts, path)
    assert read_traceset(path) == ts
