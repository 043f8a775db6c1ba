"""``mori vllm-args``: the vLLM flags it prints, parsed back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mori.cli.main import main
from mori.cli.vllm_args_cmd import SCHEDULER_CPU, SCHEDULER_GPU, vllm_flags
from mori.plugin_channel.protocol import DEFAULT_LABEL_ENDPOINT
from mori.vllm_plugin.connector_config import kv_transfer_config, tokens_per_chunk

SRC = Path(__file__).resolve().parents[2] / "src"
BASE = {"--scheduling-policy": "priority", "--enable-prefix-caching": None,
        "--enable-prompt-tokens-details": None}


def printed(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert main(["vllm-args", *argv]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
    line = out.rstrip("\n")
    assert "  " not in line and "'" not in line and "\\" not in line
    return line.split(" ")


def parse(words: list[str]) -> dict[str, Any]:
    """The flags as {flag: value} (None for a bare flag); JSON values decoded."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        flag = words[i]
        assert flag.startswith("--"), words
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            value: Any = words[i + 1]
            if value.startswith("{"):
                value = json.loads(value)
            out[flag] = value
            i += 2
        else:
            out[flag] = None
            i += 1
    return out


def test_gpu_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    words = printed(capsys)
    assert words == printed(capsys, "--gpu")
    flags = parse(words)
    assert flags == {
        "--scheduler-cls": SCHEDULER_GPU,
        "--additional-config": {"mori_label_endpoint": DEFAULT_LABEL_ENDPOINT},
        "--kv-events-config": {"enable_kv_cache_events": True, "publisher": "zmq",
                               "endpoint": "tcp://*:5557", "topic": "kv-events"},
        **BASE}


def test_cpu_build_and_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    flags = parse(printed(capsys, "--cpu-build", "--label-endpoint", "tcp://127.0.0.1:6558",
                          "--kv-events-endpoint", "tcp://*:6557"))
    assert flags["--scheduler-cls"] == SCHEDULER_CPU
    assert flags["--additional-config"] == {"mori_label_endpoint": "tcp://127.0.0.1:6558"}
    assert flags["--kv-events-config"]["endpoint"] == "tcp://*:6557"
    assert "--kv-offloading-size" not in flags


def test_cpu_gib_with_the_plugin_loads_moris_cpu_tier_order(
        capsys: pytest.CaptureFixture[str]) -> None:
    """On GPUs: vLLM's own spec and copies, MORI's eviction order."""
    flags = parse(printed(capsys, "--gpu", "--cpu-gib", "64"))
    assert "--kv-offloading-size" not in flags
    cfg = flags["--kv-transfer-config"]
    assert (cfg["kv_connector"], cfg["kv_role"]) == ("OffloadingConnector", "kv_both")
    assert cfg["kv_connector_extra_config"] == {
        "cpu_bytes_to_use": 64 << 30, "eviction_policy": "MoriCachePolicy",
        "cache_policy_module_path": "mori.vllm_plugin.cpu_tier",
        "offload_prompt_only": False}


def test_cpu_gib_on_the_cpu_build_uses_moris_host_spec(
        capsys: pytest.CaptureFixture[str]) -> None:
    extra = parse(printed(capsys, "--cpu-build", "--cpu-gib", "0.5"))[
        "--kv-transfer-config"]["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 1 << 29
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "MoriHostOffloadingSpec", "mori.vllm_plugin.host_tier")
    assert extra["eviction_policy"] == "MoriCachePolicy"


def test_cpu_gib_without_the_plugin_is_vllms_lru_tier(
        capsys: pytest.CaptureFixture[str]) -> None:
    flags = parse(printed(capsys, "--gpu", "--no-plugin", "--cpu-gib", "64"))
    assert flags["--kv-offloading-size"] == "64"
    assert flags["--kv-offloading-backend"] == "native"
    assert parse(printed(capsys, "--no-plugin", "--cpu-gib", "0.5"))[
        "--kv-offloading-size"] == "0.5"
    extra = parse(printed(capsys, "--cpu-build", "--no-plugin", "--cpu-gib", "0.25"))[
        "--kv-transfer-config"]["kv_connector_extra_config"]
    assert extra["eviction_policy"] == "lru" and "cache_policy_module_path" not in extra
    assert extra["spec_name"] == "MoriHostOffloadingSpec"


DISK_TIER = {"type": "MoriDiskTier", "module_path": "mori.vllm_plugin.disk_tier"}


def test_disk_gib_puts_moris_disk_tier_behind_the_cpu_tier(
        capsys: pytest.CaptureFixture[str]) -> None:
    extra = parse(printed(capsys, "--cpu-build", "--cpu-gib", "0.5", "--disk-gib", "2",
                          "--disk-dir", "/mnt/nvme/kv"))["--kv-transfer-config"][
        "kv_connector_extra_config"]
    # the CPU build: vLLM's tiering spec with MORI's copy worker
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "MoriTieringOffloadingSpec", "mori.vllm_plugin.host_tier")
    assert extra["eviction_policy"] == "MoriCachePolicy"
    assert extra["secondary_tiers"] == [
        {**DISK_TIER, "path": "/mnt/nvme/kv", "capacity_bytes": 2 << 30}]
    gpu = parse(printed(capsys, "--gpu", "--cpu-gib", "64", "--disk-gib", "1024",
                        "--disk-dir", "/kv"))["--kv-transfer-config"][
        "kv_connector_extra_config"]
    assert gpu["spec_name"] == "TieringOffloadingSpec" and "spec_module_path" not in gpu
    assert gpu["secondary_tiers"][0]["capacity_bytes"] == 1024 << 30
    # without the plug-in: the same tiers, vLLM's LRU on the CPU tier (and the disk
    # tier unbound: LRU too), not --kv-offloading-size
    plain = parse(printed(capsys, "--gpu", "--no-plugin", "--cpu-gib", "64", "--disk-gib",
                          "128", "--disk-dir", "/kv"))
    assert "--kv-offloading-size" not in plain
    extra = plain["--kv-transfer-config"]["kv_connector_extra_config"]
    assert extra["eviction_policy"] == "lru" and extra["secondary_tiers"][0]["path"] == "/kv"


@pytest.mark.parametrize(("argv", "says"), [
    (["--disk-gib", "1", "--disk-dir", "/kv"], "give --cpu-gib"),
    (["--cpu-gib", "1", "--disk-gib", "1"], "both --disk-gib N and --disk-dir"),
    (["--cpu-gib", "1", "--disk-dir", "/kv"], "both --disk-gib N and --disk-dir"),
    (["--cpu-gib", "1", "--disk-gib", "1", "--disk-dir", "/my kv"], "--disk-dir"),
    (["--cpu-gib", "1", "--disk-gib", "1e-12", "--disk-dir", "/kv"], "less than one byte"),
])
def test_disk_tier_errors(argv: list[str], says: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-args", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and says in captured.err


def test_kv_transfer_config_refuses_half_a_disk_tier() -> None:
    with pytest.raises(ValueError, match="both"):
        kv_transfer_config(1 << 20, disk_bytes=1 << 30)
    with pytest.raises(ValueError, match="> 0"):
        kv_transfer_config(1 << 20, disk_bytes=0, disk_dir="/kv")


def test_a_cpu_tier_under_one_byte_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-args", "--cpu-build", "--cpu-gib", "1e-12"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "less than one byte" in captured.err


@pytest.mark.parametrize("argv", [["--gpu", "--cpu-build"], ["--cpu-gib", "0"],
                                  ["--cpu-gib", "lots"], ["--cpu-gib", "nan"]])
def test_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-args", *argv]) == 2
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("endpoint", ["tcp://a b:1", "tcp://'x':1", 'tcp://"x":1', ""])
def test_endpoints_that_would_break_the_line_are_refused(
        endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-args", "--label-endpoint", endpoint]) == 2
    assert "--label-endpoint" in capsys.readouterr().err


def test_no_plugin_leaves_the_plugin_flags_out(capsys: pytest.CaptureFixture[str]) -> None:
    flags = parse(printed(capsys, "--no-plugin"))
    assert "--scheduler-cls" not in flags and "--additional-config" not in flags
    assert flags["--kv-events-config"]["publisher"] == "zmq"
    assert BASE.items() <= flags.items()


def test_help_says_what_the_cpu_build_tier_proves(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-args", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "it runs the tier's control path, not its speed" in text
    assert "vllm serve MODEL $(mori vllm-args" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_command_substitution_gives_the_same_words() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    script = ('set -- $("$0" -m mori vllm-args --cpu-build --kv-events-endpoint '
              'tcp://*:6557); printf "%s\\n" "$@"')
    res = subprocess.run(["bash", "-c", script, sys.executable], capture_output=True,
                         text=True, env=env, check=True, timeout=120)
    assert res.stdout.splitlines() == vllm_flags(build="cpu",
                                                 kv_events_endpoint="tcp://*:6557")


def test_kv_transfer_config() -> None:
    cfg = kv_transfer_config(1 << 30, host_spec=False)
    assert cfg["kv_connector"] == "OffloadingConnector"
    extra = cfg["kv_connector_extra_config"]
    assert extra == {"cpu_bytes_to_use": 1 << 30, "eviction_policy": "MoriCachePolicy",
                     "cache_policy_module_path": "mori.vllm_plugin.cpu_tier",
                     "offload_prompt_only": False}
    extra = kv_transfer_config(1, block_size=64)["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"], extra["block_size"]) == (
        "MoriHostOffloadingSpec", "mori.vllm_plugin.host_tier", 64)
    with pytest.raises(ValueError):
        kv_transfer_config(0)


@pytest.mark.parametrize("extra, tokens", [
    (None, 32), ({}, 32), ({"block_size": 128}, 128), ({"blocks_per_chunk": 4}, 128)])
def test_tokens_per_chunk_as_vllm_derives_it(extra: dict[str, int] | None,
                                             tokens: int) -> None:
    assert tokens_per_chunk(extra, 32) == tokens


def test_the_label_secret_goes_in_the_additional_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "label.key"
    key.write_text("k" * 64 + "\n")
    words = printed(capsys, "--label-endpoint", "tcp://10.0.0.5:5558",
                    "--label-secret-file", str(key))
    assert parse(words)["--additional-config"] == {
        "mori_label_endpoint": "tcp://10.0.0.5:5558", "mori_label_secret_file": str(key)}
    assert "--label-secret-file" not in parse(printed(capsys, "--no-plugin",
                                                      "--label-secret-file", str(key)))


@pytest.mark.parametrize("endpoint", ["tcp://*:5558", "tcp://0.0.0.0:5558",
                                      "tcp://10.0.0.5:5558"])
def test_an_open_label_endpoint_without_a_secret_is_warned_about(
        endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-args", "--label-endpoint", endpoint]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("mori vllm-args: warning: ")
    assert "refuses to start" in captured.err and "--label-secret-file" in captured.err
    assert main(["vllm-args", "--label-endpoint", "tcp://127.0.0.1:5558"]) == 0
    assert capsys.readouterr().err == ""  # loopback: no secret needed
    assert main(["vllm-args", "--no-plugin", "--label-endpoint", endpoint]) == 0
    assert capsys.readouterr().err == ""  # no plug-in, no label channel


def test_an_unreadable_secret_file_is_warned_about(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm-args", "--label-secret-file", str(tmp_path / "none")]) == 0
    err = capsys.readouterr().err
    assert "mori vllm-args: warning: --label-secret-file" in err
    assert "refuses to start unless it can read it" in err
    assert main(["vllm-args", "--label-secret-file", "a b"]) == 2  # would break the line
