"""Auto-detecting loader and the shipped default trace set."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import mori.traces as traces
from mori.core.registry import UnknownNameError
from mori.traces import (
    SHIPPED_TRACES,
    GapKind,
    TraceError,
    TraceSet,
    default_traces,
    load_kvcache_tester_file,
    load_traces,
    read_traceset,
    shipped_traces,
    write_traceset,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "kv-cache-tester"


def test_public_names() -> None:
    for name in traces.__all__:
        assert hasattr(traces, name), name


def test_directory_of_json(tmp_path: Path) -> None:
    ts = load_traces(DATA)
    assert ts.name == "kv-cache-tester"
    assert [p.name for p in ts.programs] == ["trace_0021", "trace_0101", "trace_0121"]
    assert load_traces(str(DATA)) == ts


def test_single_json() -> None:
    ts = load_traces(DATA / "trace_0021.json")
    assert ts.name == "trace_0021"
    assert ts.programs == (load_kvcache_tester_file(DATA / "trace_0021.json"),)


@pytest.mark.parametrize("name", ["set.jsonl", "set.jsonl.gz", "SET.JSONL.GZ"])
def test_canonical_file(tmp_path: Path, name: str) -> None:
    ts = load_traces(DATA)
    write_traceset(ts, tmp_path / name)
    assert (tmp_path / name).read_bytes().startswith(b"\x1f\x8b") == name.lower().endswith(".gz")
    assert load_traces(tmp_path / name) == ts


def test_rejected_forms(tmp_path: Path) -> None:
    other = tmp_path / "trace.csv"
    other.write_text("a,b\n")
    with pytest.raises(TraceError) as info:
        load_traces(other)
    message = str(info.value)
    assert message.startswith(str(other))
    for form in ("directory of kv-cache-tester *.json", ".json file", ".jsonl / .jsonl.gz"):
        assert form in message
    with pytest.raises(TraceError, match="no such file or directory"):
        load_traces(tmp_path / "absent.jsonl")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TraceError, match=r"empty: no \*\.json"):
        load_traces(empty)


def test_directory_error_names_file(tmp_path: Path) -> None:
    shutil.copy(DATA / "trace_0021.json", tmp_path / "a.json")
    (tmp_path / "b.json").write_text('{"requests": [{"t": 0, "out": 1}]}')
    with pytest.raises(TraceError, match=r"b\.json: requests\[0\]: missing field 'in'"):
        load_traces(tmp_path)


def test_default_traces() -> None:
    ts = default_traces()
    assert isinstance(ts, TraceSet)
    assert ts.name == "kv-cache-tester-31"
    assert len(ts) == 31
    names = [p.name for p in ts.programs]
    assert names[0] == "trace_0001" and names[-1] == "trace_0721"
    assert all(int(n[-4:]) % 20 == 1 for n in names)
    assert sum(len(p.steps) for p in ts.programs) == 1935
    for program in ts.programs:
        assert program.source == f"kv-cache-tester/traces/{program.name}.json"
        assert program.shared_prefix_tokens > 0
        assert program.steps[-1].gap_kind is GapKind.END
        assert all(s.gap_s >= 0 and s.reuse_tokens <= s.prompt_tokens for s in program.steps)


def test_default_traces_match_the_loader() -> None:
    shipped = {p.name: p for p in default_traces().programs}
    for program in load_traces(DATA).programs:
        expected = shipped[program.name]
        assert program.steps == expected.steps
        assert program.shared_prefix_tokens == expected.shared_prefix_tokens


def test_shipped_license_files() -> None:
    data = Path(traces.__file__).resolve().parents[1] / "data"
    assert "Apache License" in (data / "LICENSE-kv-cache-tester").read_text()
    notice = (data / "NOTICE").read_text()
    for needle in ("callanjfox/kv-cache-tester", "94f6046", "Apache", "WEKA", "hash"):
        assert needle in notice


def test_a_shipped_set_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert "kv-cache-tester-31" in SHIPPED_TRACES
    assert load_traces("kv-cache-tester-31") == default_traces()
    assert load_traces(Path("kv-cache-tester-31")) == shipped_traces("kv-cache-tester-31")
    with pytest.raises(TraceError) as info:
        load_traces("kv-cache-tester-32")
    message = str(info.value)
    assert message.startswith("kv-cache-tester-32: no such file or directory")
    assert message.endswith("or the name of a shipped trace set: kv-cache-tester-31")
    with pytest.raises(UnknownNameError, match="valid names: kv-cache-tester-31"):
        shipped_traces("nope")
    # a file or folder of that name wins over the shipped set
    shutil.copytree(DATA, tmp_path / "kv-cache-tester-31")
    assert len(load_traces("kv-cache-tester-31")) == 3


def test_shipped_sets_are_what_they_say() -> None:
    data = Path(traces.__file__).resolve().parents[1] / "data"
    for name in SHIPPED_TRACES.names():
        shipped = SHIPPED_TRACES.get(name)
        assert read_traceset(data / shipped.file).name == name
        assert shipped.size_bytes() == (data / shipped.file).stat().st_size
        assert shipped.licence and all((data / f).is_file() for f in shipped.notice)
