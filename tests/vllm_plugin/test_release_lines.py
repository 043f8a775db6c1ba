"""scripts/vllm_release_lines.py on hand-made release sources (no vLLM needed): a hook
only one release's base class declares counts for that release, marked statements for
the releases they name, and a parameter some releases pass is listed."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_release_lines.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_release_lines", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def release(tmp: Path, name: str, policy_methods: str) -> Path:
    """A vllm package whose ``CachePolicy`` (the only base resolved) has these methods."""
    root = tmp / name / "vllm"
    base = root / "v1" / "kv_offload" / "cpu" / "policies"
    base.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (base / "base.py").write_text("class CachePolicy:\n" + policy_methods)
    return root


OLD = """    def insert(self, key, chunk): ...
    def touch(self, keys, req_context): ...
    def evict(self, n, protected): ...
"""
NEW = """    def insert(self, key, chunk, req_context): ...
    def on_request_access(self, keys, req_context): ...
    def evict(self, n, protected): ...
"""


def test_counts_hooks_of_some_releases_and_marked_statements(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = load()
    sources = {"0.32": release(tmp_path, "a", OLD), "0.33": release(tmp_path, "b", NEW)}
    rep = mod.analyse(sources)
    by_what = {(s.module, s.what): s for s in rep.spans}
    touch = by_what[("cpu_tier", "MoriCachePolicy.touch")]
    access = by_what[("cpu_tier", "MoriCachePolicy.on_request_access")]
    assert touch.releases == {"0.32"} and access.releases == {"0.33"}
    assert access.lines > 5
    # a hook both declare (evict, insert) is one code path, not counted
    assert ("cpu_tier", "MoriCachePolicy.evict") not in by_what
    assert ("cpu_tier", "MoriCachePolicy.insert") not in by_what
    # the marked statements, whatever the sources
    marked = by_what[("cpu_tier", "on_store_miss")]
    assert marked.why == "marked" and marked.releases == {"0.32"}
    assert "cpu_tier.MoriCachePolicy.insert: `req_context` passed by 0.33" in rep.params

    assert mod.main(["--source", f"0.32={sources['0.32']}",
                     "--source", f"0.33={sources['0.33']}"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert int(rows["0.32"][1]) >= touch.lines + marked.lines
    assert int(rows["0.33"][1]) >= access.lines
    assert "0.34" not in rows or rows["0.34"][1].isdigit()


def test_a_mark_not_before_a_statement_is_refused(tmp_path: Path) -> None:
    mod = load()
    src = tmp_path / "m.py"
    lines = ["x = 1", "# vllm-release: 0.34"]
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match="not before a statement"):
        mod.marked_spans(src, ast.parse(src.read_text()), lines)
    ok = ["# vllm-release: 0.34", "if x:", "    y = 2", "z = 3"]
    src.write_text("\n".join(ok) + "\n")
    (span,) = mod.marked_spans(src, ast.parse(src.read_text()), ok)
    assert (span.start, span.end, span.releases) == (2, 3, frozenset({"0.34"}))


def test_no_source_is_exit_1(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mod = load()
    monkeypatch.setattr(mod, "default_sources", lambda: {})
    assert mod.main(["--source", f"0.32={tmp_path / 'nothing'}"]) == 1
