"""``mori sglang-args``: the SGLang flags it prints, parsed back (no SGLang needed; the
flags parsed by SGLang's own parser: ``tests/sglang_inside/test_flags.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mori.cli import sglang_args_cmd
from mori.cli.main import main
from mori.cli.sglang_args_cmd import TESTED_SGLANG, release_warning, sglang_flags
from mori.plugin_channel.protocol import DEFAULT_LABEL_ENDPOINT

SRC = Path(__file__).resolve().parents[2] / "src"
EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
          "topic": "kv-events"}


@pytest.fixture(autouse=True)
def _no_sglang_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if no SGLang were installed beside mori (tests that want one patch it)."""
    monkeypatch.setattr(sglang_args_cmd, "installed_sglang", lambda: None)


def parse(words: list[str]) -> dict[str, Any]:
    """The flags as {flag: value} (None for a bare flag); the JSON value decoded."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        flag = words[i]
        assert flag.startswith("--") and flag not in out, words
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
            out[flag] = json.loads(value) if value.startswith("{") else value
            i += 2
        else:
            out[flag] = None
            i += 1
    return out


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[str], str]:
    """The words printed on stdout, and stderr."""
    assert main(["sglang-args", *argv]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.endswith("\n") and out.count("\n") == 1
    line = out.rstrip("\n")
    assert "  " not in line and "'" not in line and "\\" not in line
    return line.split(" "), captured.err


def test_the_default_loads_the_plugin_without_hicache(
        capsys: pytest.CaptureFixture[str]) -> None:
    words, err = printed(capsys)
    assert err == ""
    assert words[:2] == ["--radix-cache-backend", "mori"]
    assert parse(words) == {"--radix-cache-backend": "mori",
                            "--enable-priority-scheduling": None, "--enable-metrics": None,
                            "--kv-events-config": EVENTS}


def test_hicache_defaults_to_write_back_at_twice_the_gpu_pool(
        capsys: pytest.CaptureFixture[str]) -> None:
    words, _ = printed(capsys, "--hicache")
    assert words[-5:] == ["--enable-hierarchical-cache", "--hicache-ratio", "2",
                          "--hicache-write-policy", "write_back"]
    assert parse(words)["--radix-cache-backend"] == "mori"


@pytest.mark.parametrize("ratio, shown", [("4", "4"), ("1.5", "1.5"), ("2.0", "2")])
def test_hicache_options(ratio: str, shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags = parse(printed(capsys, "--hicache", "--hicache-ratio", ratio,
                          "--hicache-write-policy", "write_through_selective")[0])
    assert flags["--hicache-ratio"] == shown
    assert flags["--hicache-write-policy"] == "write_through_selective"


def test_no_plugin_is_sglangs_priority_eviction(capsys: pytest.CaptureFixture[str]) -> None:
    words, _ = printed(capsys, "--no-plugin", "--hicache")
    flags = parse(words)
    assert "--radix-cache-backend" not in flags
    assert words[:2] == ["--radix-eviction-policy", "priority"]
    assert flags["--enable-priority-scheduling"] is None
    assert flags["--kv-events-config"] == EVENTS
    assert flags["--hicache-write-policy"] == "write_back"


def test_the_kv_events_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    flags = parse(printed(capsys, "--kv-events-endpoint", "tcp://*:6557")[0])
    assert flags["--kv-events-config"] == {**EVENTS, "endpoint": "tcp://*:6557"}


def test_a_label_endpoint_is_a_note_to_set_the_environment(
        capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang has no flag for it: the flags do not change, stderr says what to set."""
    words, err = printed(capsys, "--label-endpoint", "tcp://127.0.0.1:6558")
    assert words == sglang_flags()
    assert err.count("\n") == 1
    assert err.startswith("mori sglang-args: note: ")
    assert "MORI_LABEL_ENDPOINT=tcp://127.0.0.1:6558" in err
    _, err = printed(capsys, "--label-endpoint", DEFAULT_LABEL_ENDPOINT)
    assert err == ""  # the plug-in binds the default anyway
    _, err = printed(capsys, "--no-plugin", "--label-endpoint", "tcp://127.0.0.1:6558")
    assert err == ""  # no plug-in, no label endpoint


@pytest.mark.parametrize("argv, message", [
    (["--hicache", "--hicache-ratio", "1"], "must be above 1"),
    (["--hicache", "--hicache-ratio", "0.5"], "must be above 1"),
    (["--hicache", "--hicache-ratio", "nan"], "must be above 1"),
    (["--hicache", "--hicache-ratio", "lots"], "not a number"),
    (["--hicache", "--hicache-write-policy", "write_around"], "invalid choice"),
    (["--hicache-ratio", "3"], "need --hicache"),
    (["--hicache-write-policy", "write_through"], "need --hicache"),
])
def test_usage_errors(argv: list[str], message: str,
                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sglang-args", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("mori sglang-args: error: ")
    assert message in captured.err and captured.err.count("\n") == 1


@pytest.mark.parametrize("option", ["--label-endpoint", "--kv-events-endpoint"])
@pytest.mark.parametrize("endpoint", ["tcp://a b:1", "tcp://'x':1", 'tcp://"x":1',
                                      "tcp://x\\y:1", ""])
def test_endpoints_that_would_break_the_line_are_refused(
        option: str, endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sglang-args", option, endpoint]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and option in captured.err


def test_the_function_checks_what_argparse_checks() -> None:
    with pytest.raises(ValueError, match="above 1"):
        sglang_flags(hicache=True, hicache_ratio=1.0)
    with pytest.raises(ValueError, match="write_back"):
        sglang_flags(hicache=True, hicache_write_policy="write_around")
    with pytest.raises(ValueError, match="need --hicache"):
        sglang_flags(hicache_ratio=3.0)


def test_another_sglang_beside_mori_is_warned_about(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sglang_args_cmd, "installed_sglang", lambda: "0.5.24")
    words, err = printed(capsys)
    assert words == sglang_flags()
    assert err.startswith("mori sglang-args: warning: SGLang 0.5.24 is installed here")
    assert TESTED_SGLANG in err and "--no-plugin" in err
    _, err = printed(capsys, "--no-plugin")
    assert err == ""
    assert release_warning(TESTED_SGLANG, plugin=True) is None
    assert release_warning(None, plugin=True) is None


def test_installed_sglang_reads_the_metadata_only() -> None:
    """Without importing SGLang (here it is not installed: None)."""
    code = ("import sys; from mori.cli.sglang_args_cmd import installed_sglang; "
            "v = installed_sglang(); print('sglang' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)}, check=True, timeout=120)
    assert res.stdout.strip() == "False"


def test_help_explains_the_plugin_the_environment_and_the_gateway(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sglang-args", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "unowned pages first, then the inactive programs', the idle, the busy" in text
    assert "on HiCache's host tier unowned, inactive, busy, then idle" in text
    assert "installed in SGLang's environment (pip install /path/to/mori there)" in text
    assert "MORI_LABEL_ENDPOINT=ADDR" in text
    assert "$(mori sglang-args --hicache)" in text
    assert "mori serve --backend sglang=URL,labels=tcp://127.0.0.1:5558" in text
    assert "tensor parallelism above 1" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_command_substitution_gives_the_same_words() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    script = ('set -- $("$0" -m mori sglang-args --hicache --kv-events-endpoint '
              'tcp://*:6557); printf "%s\\n" "$@"')
    res = subprocess.run(["bash", "-c", script, sys.executable], capture_output=True,
                         text=True, env=env, check=True, timeout=120)
    assert res.stdout.splitlines() == sglang_flags(hicache=True,
                                                   kv_events_endpoint="tcp://*:6557")


def test_the_label_secret_is_a_note_to_set_the_environment(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "label.key"
    key.write_text("k" * 64 + "\n")
    words, err = printed(capsys, "--label-endpoint", "tcp://10.0.0.5:5558",
                         "--label-secret-file", str(key))
    assert words == sglang_flags()
    assert f"MORI_LABEL_SECRET_FILE={key}" in err and "warning" not in err
    _, err = printed(capsys, "--label-endpoint", "tcp://*:5558")
    assert "mori sglang-args: warning: " in err and "refuses to start" in err
    assert "--label-secret-file" in err
    _, err = printed(capsys, "--no-plugin", "--label-endpoint", "tcp://*:5558")
    assert err == ""
