"""kv-cache-tester loader: real files, the subagent path (synthetic), and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mori.traces import GapKind, TraceError, load_kvcache_tester_dir, load_kvcache_tester_file

DATA = Path(__file__).resolve().parents[1] / "data" / "kv-cache-tester"
REAL_FILES = sorted(DATA.glob("trace_*.json"))


def _llm_requests(raw: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in raw["requests"] if r.get("type") != "subagent"]


def _write(tmp_path: Path, data: object, name: str = "trace_x.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_real_files_present() -> None:
    assert [p.name for p in REAL_FILES] == ["trace_0021.json", "trace_0101.json", "trace_0121.json"]


@pytest.mark.parametrize("path", REAL_FILES, ids=lambda p: p.name)
def test_real_file_counts_and_bounds(path: Path) -> None:
    raw = json.loads(path.read_text())
    llm = _llm_requests(raw)
    program = load_kvcache_tester_file(path)
    assert program.name == raw["id"]
    assert program.source == str(path)
    assert program.shared_prefix_tokens == raw["tool_tokens"] + raw["system_tokens"]
    assert len(program.steps) == len(llm)
    assert sum(s.prompt_tokens for s in program.steps) == sum(r["in"] for r in llm)
    assert sum(s.output_tokens for s in program.steps) == sum(r["out"] for r in llm)
    assert sum(r["in"] for r in llm) == raw["totals"]["parent_tokens"]["input"]
    assert program.steps[0].reuse_tokens == 0
    for step in program.steps:
        assert step.gap_s >= 0
        assert 0 <= step.reuse_tokens <= step.prompt_tokens
        assert step.reuse_tokens % raw["block_size"] == 0 or step.reuse_tokens == step.prompt_tokens
        assert not step.subagents
    for step, prev, req in zip(program.steps[1:], llm, llm[1:], strict=False):
        assert step.reuse_tokens > 0
        common = 0
        for a, b in zip(prev["hash_ids"], req["hash_ids"], strict=False):
            if a != b:
                break
            common += 1
        assert step.reuse_tokens == min(req["in"], common * raw["block_size"])
    for step, req in zip(program.steps[:-1], llm, strict=False):
        expected = GapKind.TOOL if req["stop"] == "tool_use" else GapKind.HUMAN
        assert step.gap_kind is expected
    assert program.steps[-1].gap_kind is GapKind.END
    assert program.steps[-1].gap_s == 0


def test_gap_uses_think_time() -> None:
    path = DATA / "trace_0021.json"
    llm = _llm_requests(json.loads(path.read_text()))
    program = load_kvcache_tester_file(path)
    for step, cur, nxt in zip(program.steps, llm, llm[1:], strict=False):
        assert step.gap_s == min(nxt["think_time"], nxt["t"] - cur["t"])


def test_gap_without_think_time_or_api_time() -> None:
    # trace_0101: request 1 lacks think_time and request 0 lacks api_time.
    path = DATA / "trace_0101.json"
    llm = _llm_requests(json.loads(path.read_text()))
    assert "think_time" not in llm[1] and "api_time" not in llm[0]
    gaps = [s.gap_s for s in load_kvcache_tester_file(path).steps]
    assert gaps == [llm[1]["t"] - llm[0]["t"], llm[2]["think_time"], 0.0]


def _call(t: float, n_in: int, hashes: list[int], **extra: Any) -> dict[str, Any]:
    return {"t": t, "type": "n", "in": n_in, "out": 1, "hash_ids": hashes, **extra}


def test_gap_rules_synthetic(tmp_path: Path) -> None:
    reqs = [
        _call(0, 10, [1], stop="tool_use", api_time=2.0),
        _call(10, 10, [1], think_time=5.0, stop="end_turn", api_time=3.0),  # think 5
        _call(20, 10, [1], stop=""),  # no think_time: 20 - 10 - api 3 = 7
        _call(50, 10, [1], think_time=50.0, stop="tool_use"),  # think 50 capped at 50 - 20
        _call(49, 10, [1]),  # clock going back: 0, never negative
    ]
    steps = load_kvcache_tester_file(_write(tmp_path, {"requests": reqs})).steps
    assert [s.gap_s for s in steps] == [5.0, 7.0, 30.0, 0.0, 0.0]
    assert [s.gap_kind for s in steps] == [
        GapKind.TOOL,
        GapKind.HUMAN,
        GapKind.HUMAN,
        GapKind.TOOL,
        GapKind.END,
    ]


def test_defaults_name_block_size_and_prefix(tmp_path: Path) -> None:
    reqs = [_call(0, 200, [1, 2, 3]), _call(1, 300, [1, 2, 4, 5]), _call(2, 100, [1, 2, 4, 5])]
    program = load_kvcache_tester_file(_write(tmp_path, {"requests": reqs}, "my_trace.json"))
    assert program.name == "my_trace"
    assert program.shared_prefix_tokens == 0
    assert [s.reuse_tokens for s in program.steps] == [0, 128, 100]  # 64-token blocks, capped


SUBAGENT_TRACE: dict[str, Any] = {
    "id": "syn",
    "block_size": 4,
    "tool_tokens": 10,
    "system_tokens": 2,
    "requests": [
        _call(0, 16, [1, 2, 3, 4], stop="tool_use", api_time=2.0),
        {
            "type": "subagent",
            "t": 3.0,
            "agent_id": "a1",
            "duration_ms": 10000,
            "requests": [
                _call(3.0, 8, [1, 9], stop="tool_use", api_time=1.0),
                _call(6.0, 12, [1, 9, 10], stop="end_turn", api_time=1.0, think_time=2.0),
            ],
        },
        {
            "type": "subagent",
            "t": 4.0,
            "agent_id": "a2",
            "duration_ms": 12000,
            "requests": [_call(4.0, 8, [1, 7], stop="end_turn")],
        },
        _call(20.0, 24, [1, 2, 3, 4, 5, 6], stop="end_turn", api_time=1.0, think_time=3.0),
        {"type": "subagent", "t": 22.0, "agent_id": "a3", "requests": [_call(22.5, 4, [1])]},
    ],
}


def test_subagents(tmp_path: Path) -> None:
    program = load_kvcache_tester_file(_write(tmp_path, SUBAGENT_TRACE))
    assert program.shared_prefix_tokens == 12
    first, last = program.steps
    assert first.gap_kind is GapKind.SUBAGENT
    assert [s.program.name for s in first.subagents] == ["syn/a1", "syn/a2"]
    assert [s.delay_s for s in first.subagents] == [1.0, 2.0]  # t_sub - (0 + api 2)
    assert first.gap_s == 4.0  # next request at 20, a2 ends last at 4 + 12
    assert last.reuse_tokens == 16  # 4 equal blocks of 4 tokens
    assert last.gap_kind is GapKind.SUBAGENT and last.gap_s == 0.0  # ends with a3
    assert [s.delay_s for s in last.subagents] == [1.0]
    a1 = first.subagents[0].program
    assert a1.source == program.source and a1.shared_prefix_tokens == 0
    assert [(s.reuse_tokens, s.gap_s, s.gap_kind) for s in a1.steps] == [
        (0, 2.0, GapKind.TOOL),
        (8, 0.0, GapKind.END),
    ]
    assert len(program.all_programs()) == 4
    assert sum(p.steps[0].prompt_tokens for p in program.all_programs()) == 16 + 8 + 8 + 4


def test_subagent_without_llm_call_is_dropped(tmp_path: Path) -> None:
    reqs = [
        _call(0, 10, [1], stop="tool_use", api_time=1.0),
        {"type": "subagent", "t": 2, "agent_id": "empty", "duration_ms": 5, "requests": []},
        _call(10, 10, [1], think_time=9.0),
    ]
    steps = load_kvcache_tester_file(_write(tmp_path, {"requests": reqs})).steps
    assert steps[0].gap_kind is GapKind.TOOL and steps[0].gap_s == 9.0
    assert not steps[0].subagents


def test_nested_subagent_and_span_duration(tmp_path: Path) -> None:
    inner = {"type": "subagent", "t": 5, "requests": [_call(5, 4, [3])]}
    sub = {"type": "subagent", "t": 2, "agent_id": "s", "requests": [
        _call(2, 4, [1], api_time=1.0), inner, _call(7, 4, [1], api_time=2.0)]}  # fmt: skip
    reqs = [_call(0, 10, [1], api_time=1.0), sub, _call(20, 10, [1])]
    program = load_kvcache_tester_file(_write(tmp_path, {"id": "p", "requests": reqs}))
    spawn = program.steps[0].subagents[0]
    assert program.steps[0].gap_s == 20 - (2 + 7)  # no duration_ms: span 2 .. 7 + 2
    nested = spawn.program.steps[0].subagents[0]
    assert nested.program.name == "p/s/#1" and nested.delay_s == 2.0
    assert [p.name for p in program.all_programs()] == ["p", "p/s", "p/s/#1"]


def test_directory(tmp_path: Path) -> None:
    ts = load_kvcache_tester_dir(DATA)
    assert ts.name == "kv-cache-tester"
    assert [p.name for p in ts.programs] == ["trace_0021", "trace_0101", "trace_0121"]
    with pytest.raises(TraceError, match="no \\*.json"):
        load_kvcache_tester_dir(tmp_path)


GOOD: dict[str, Any] = {
    "id": "bad",
    "requests": [
        _call(0, 10, [1], stop="tool_use"),
        {"type": "subagent", "t": 1, "requests": [_call(1, 5, [2])]},
        _call(2, 10, [1]),
    ],
}


_DELETE = object()


def _mutated(path: str, value: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(GOOD))
    *parents, last = path.split("/")
    target: Any = data
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is _DELETE:
        del target[int(last) if last.isdigit() else last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return data


BAD_CASES = [
    ("requests", _DELETE, "trace_x.json: missing field 'requests'"),
    ("requests", {}, "trace_x.json: requests: expected an array, got object"),
    ("requests", [], "trace_x.json: requests: no LLM request"),
    ("requests/0", 3, "trace_x.json: requests[0]: expected a JSON object, got integer"),
    ("requests/0/in", _DELETE, "trace_x.json: requests[0]: missing field 'in'"),
    ("requests/2/out", _DELETE, "trace_x.json: requests[2]: missing field 'out'"),
    ("requests/2/t", None, "trace_x.json: requests[2]: field 't' is null"),
    ("requests/0/in", "10", "requests[0].in: expected a non-negative integer, got string"),
    ("requests/0/in", True, "requests[0].in: expected a non-negative integer, got boolean"),
    ("requests/0/out", 1.5, "requests[0].out: expected a non-negative integer, got number"),
    ("requests/0/t", "0", "requests[0].t: expected a non-negative number, got string"),
    ("requests/0/out", -1, "requests[0].out: must not be negative, got -1"),
    ("requests/2/think_time", -2.0, "requests[2].think_time: must not be negative"),
    ("requests/0/api_time", [1], "requests[0].api_time: expected a non-negative number"),
    ("requests/0/hash_ids", "1,2", "requests[0].hash_ids: expected an array, got string"),
    ("requests/0/stop", 7, "requests[0].stop: expected a string, got integer"),
    ("requests/1/requests/0/in", _DELETE, "requests[1].requests[0]: missing field 'in'"),
    ("requests/1/requests", _DELETE, "requests[1]: missing field 'requests'"),
    ("requests/1/duration_ms", -5, "requests[1].duration_ms: must not be negative"),
    ("block_size", 0, "trace_x.json: block_size: must be positive"),
    ("tool_tokens", -3, "trace_x.json: tool_tokens: must not be negative"),
    ("id", 12, "trace_x.json: id: expected a string, got integer"),
]


@pytest.mark.parametrize(("path", "value", "message"), BAD_CASES)
def test_bad_input_names_file_and_field(
    tmp_path: Path, path: str, value: Any, message: str
) -> None:
    assert load_kvcache_tester_file(_write(tmp_path, GOOD)).name == "bad"
    with pytest.raises(TraceError) as info:
        load_kvcache_tester_file(_write(tmp_path, _mutated(path, value)))
    assert message in str(info.value)
    assert str(tmp_path / "trace_x.json") in str(info.value)


def test_subagent_before_first_call(tmp_path: Path) -> None:
    reqs = [{"type": "subagent", "t": 0, "requests": [_call(0, 1, [1])]}, _call(1, 1, [1])]
    with pytest.raises(TraceError, match=r"trace_x\.json: requests\[0\]: subagent before"):
        load_kvcache_tester_file(_write(tmp_path, {"requests": reqs}))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"id": "x",\n  "requests": [\n', "trace_x.json: line 3, column 1: invalid JSON"),
        ('{"requests": [}', "trace_x.json: line 1, column 15: invalid JSON"),
        ("", "trace_x.json: line 1, column 1: invalid JSON"),
        ("[1, 2]", "trace_x.json: expected a JSON object, got array"),
    ],
)
def test_not_json(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(TraceError) as info:
        load_kvcache_tester_file(_write(tmp_path, text))
    assert message in str(info.value)


def test_not_utf8_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "trace_x.json"
    path.write_bytes(b'{"id": "\xff\xfe\xfd"}')
    with pytest.raises(TraceError, match="trace_x.json"):
        load_kvcache_tester_file(path)
    with pytest.raises(TraceError, match=r"nope\.json: cannot read file"):
        load_kvcache_tester_file(tmp_path / "nope.json")


def test_trace_error_is_value_error_and_pickles() -> None:
    import pickle

    err = TraceError("f.json", "requests[3]", "missing field 'in'", "add it")
    assert isinstance(err, ValueError)
    assert str(err) == "f.json: requests[3]: missing field 'in'; add it"
    again = pickle.loads(pickle.dumps(err))
    assert (again.file, again.where, again.problem, again.hint, str(again)) == (
        err.file,
        err.where,
        err.problem,
        err.hint,
        str(err),
    )
