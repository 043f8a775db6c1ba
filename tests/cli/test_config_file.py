"""``--config FILE.toml``: how a ``traces`` value is resolved."""

from __future__ import annotations

from pathlib import Path

from mori.cli.config_file import load_config


def test_a_shipped_set_name_stays_a_name(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('traces = "kv-cache-tester-31"\njson = "out.json"\n')
    values = load_config(cfg)
    assert values["traces"] == Path("kv-cache-tester-31")  # not tmp_path / name
    assert values["json"] == tmp_path / "out.json"


def test_a_file_beside_the_config_wins_over_a_shipped_name(tmp_path: Path) -> None:
    (tmp_path / "kv-cache-tester-31").mkdir()
    cfg = tmp_path / "run.toml"
    cfg.write_text('traces = "kv-cache-tester-31"\n')
    assert load_config(cfg)["traces"] == tmp_path / "kv-cache-tester-31"


def test_other_relative_traces_are_beside_the_config(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text('traces = "mine.jsonl"\n')
    assert load_config(cfg)["traces"] == tmp_path / "mine.jsonl"
