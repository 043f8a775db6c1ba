"""The importer registry, format detection, and load_traces on every format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mori.core.registry import UnknownNameError
from mori.traces import TraceSet, load_traces, read_traceset, write_traceset
from mori.traces.import_common import ImportOptions
from mori.traces.importers import IMPORTERS, detect_format

DATA = Path(__file__).resolve().parents[1] / "data"
CC, CODEX, KV = DATA / "claude-code", DATA / "codex", DATA / "kv-cache-tester"


def test_registry() -> None:
    assert IMPORTERS.names() == ["claude-code", "codex", "kv-cache-tester", "mori", "tracelab"]
    assert IMPORTERS.frozen
    with pytest.raises(UnknownNameError, match="valid names: claude-code, codex"):
        IMPORTERS.get("cursor")


def test_detection(tmp_path: Path) -> None:
    canonical = tmp_path / "c.jsonl.gz"
    write_traceset(load_traces(KV), canonical)
    assert detect_format(canonical) == "mori"
    assert detect_format(CC) == "claude-code"
    assert detect_format(CC / "short.jsonl") == "claude-code"
    assert detect_format(CODEX) == "codex"
    assert detect_format(next(CODEX.glob("*.jsonl"))) == "codex"
    assert detect_format(KV) == "kv-cache-tester"
    assert detect_format(KV / "trace_0021.json") == "kv-cache-tester"
    other = tmp_path / "other.jsonl"
    other.write_text('{"hello": 1}\n')
    assert detect_format(other) is None


def test_load_traces_reads_every_format() -> None:
    cc = load_traces(CC)
    assert cc.name == "claude-code" and len(cc) == 4
    assert load_traces(CC / "short.jsonl").name == "short"
    codex = load_traces(CODEX)
    assert len(codex) == 1 and len(codex.programs[0].steps) == 9
    assert load_traces(KV, format="kv-cache-tester") == load_traces(KV)


def test_kv_cache_tester_import_keeps_hashes_losslessly(tmp_path: Path) -> None:
    options = ImportOptions()
    programs = list(IMPORTERS.get("kv-cache-tester").programs([KV], options))
    assert options.report.programs == 3 and options.report.files == 3
    raw = json.loads((KV / "trace_0021.json").read_text())
    calls = [r for r in raw["requests"] if r.get("type") != "subagent"]
    first = programs[0]
    assert first.block_size == raw["block_size"]
    assert [list(s.block_hashes or ()) for s in first.steps] == [c["hash_ids"] for c in calls]
    assert [s.call_s for s in first.steps] == [c.get("api_time") for c in calls]
    ts = TraceSet("kv", tuple(programs))
    write_traceset(ts, tmp_path / "kv.jsonl.gz")
    assert read_traceset(tmp_path / "kv.jsonl.gz") == ts
    # without hashes, the same steps otherwise
    plain = load_traces(KV)
    assert all(s.block_hashes is None for p in plain.programs for s in p.steps)
    assert [s.prompt_tokens for s in plain.programs[0].steps] == \
        [s.prompt_tokens for s in first.steps]


def test_kv_cache_tester_bad_file_skipped_with_count(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text((KV / "trace_0021.json").read_text())
    (tmp_path / "b.json").write_text('{"requests": [{"t": 0}]}')
    options = ImportOptions(skip_bad=True)
    programs = list(IMPORTERS.get("kv-cache-tester").programs([tmp_path], options))
    assert len(programs) == 1 and options.report.bad_lines == 1
    assert "b.json" in options.report.bad_examples[0]
