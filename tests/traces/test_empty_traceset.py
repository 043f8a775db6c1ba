"""An empty trace set (a recording of clients the gateway recognised none of): ``mori
simulate`` says the set holds no program and what that usually means, not that no program
fits the context; ``mori trace stats`` warns."""

from __future__ import annotations

from pathlib import Path

import pytest

from mori.cli.main import main as mori_main
from mori.cli.trace_cmd import main as trace_main
from mori.gateway.record import TraceRecorder
from mori.traces import read_traceset


def empty_recording(tmp: Path) -> Path:
    path = tmp / "fleet.jsonl.gz"
    TraceRecorder(path).close(0.0)  # the gateway stopped having recorded no program
    assert read_traceset(path).programs == ()
    return path


def test_simulate_says_the_set_holds_no_program(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = empty_recording(tmp_path)
    assert mori_main(["simulate", "--traces", str(path), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "holds no program" in err and "recognised none" in err
    assert "fits a context" not in err


def test_trace_stats_warns_on_an_empty_set(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = empty_recording(tmp_path)
    assert trace_main(["trace", "stats", str(path)]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "holds no program" in err
