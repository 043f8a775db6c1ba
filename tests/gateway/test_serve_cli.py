"""``mori serve`` as a user runs it: flags, a TOML config file, errors, and the real
command serving the official ``openai`` client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from mori.cli.main import build_parser, main
from mori.cli.options import SERVE_OPTIONS, help_text
from mori.cli.serve_cmd import ServeUsageError, build_config, gateway_settings
from mori.core.policy import PolicyConfig
from support.serve_process import wait_listening


def config(argv: list[str]):  # type: ignore[no-untyped-def]
    return build_config(build_parser().parse_args(["serve", *argv]))


def test_flags_and_config_file_map_onto_one_config(tmp_path: Path) -> None:
    f = tmp_path / "serve.toml"
    f.write_text('policy = "thunderagent"\nreplicas = 3\ntime-scale = 10\n'
                 'hold_timeout = 30\nbackend = ["sim=http://127.0.0.1:9"]\n')
    cfg = config(["--config", str(f), "--replicas", "2"])
    assert cfg.replicas == 2  # the flag wins
    assert cfg.settings.policy == "thunderagent"
    assert cfg.settings.time_scale == 10.0
    assert cfg.settings.hold_timeout_s == 30.0
    assert cfg.backends == ["sim=http://127.0.0.1:9"]
    assert config([]).settings.policy == "mori" and config([]).port == 8000


@pytest.mark.parametrize("argv,needle", [
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--backend", "nope=http://x:1"], "unknown engine kind 'nope'"),
    (["--backend", "vllm=http://x:1,colour=blue"], "unknown option(s) colour"),
    (["--backend", "vllm"], "KIND=URL"),
    (["--time-scale", "0"], "time_scale must be"),
    (["--tick", "0"], "--tick: tick_s must be"),
    (["--idleness-window", "0"], "--idleness-window: idleness_window must be >= 1"),
    (["--binary-threshold", "2"], "--binary-threshold: binary_threshold must be in [0, 1]"),
    (["--preset", "h100"], "unknown preset"),
])
def test_bad_settings_say_what_is_wrong(argv: list[str], needle: str) -> None:
    with pytest.raises(ServeUsageError) as e:
        config(argv)
    assert needle in str(e.value)


def test_policy_knobs_from_flags_and_config_file(tmp_path: Path) -> None:
    f = tmp_path / "serve.toml"
    f.write_text("tick = 2\nidleness-window = 3\nexact-tokens = true\n")
    cfg = config(["--config", str(f), "--binary-threshold", "0.25"])
    knobs = PolicyConfig(tick_s=2.0, idleness_window=3, binary_threshold=0.25)
    assert cfg.settings == gateway_settings({"exact_tokens": True}, knobs)
    assert config([]).settings == gateway_settings({}, PolicyConfig())


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for opt in SERVE_OPTIONS:
        assert " ".join(help_text(opt).split()) in out
        if opt.default not in (None, False):
            assert "(default" in help_text(opt), opt.key
    assert "--tick S policy tick in seconds of policy time (default: 5)" in out
    assert "(default: 33554432)" in out and "(default: mori)" in out


def test_bad_config_file_names_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    f = tmp_path / "serve.toml"
    f.write_text("colour = 'blue'\n")
    assert main(["serve", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'colour'" in err and "serve.toml" in err
    assert "idleness-window" in err and "backend" in err  # the valid keys are listed
    f.write_text("max-held = 'many'\n")
    assert main(["serve", "--config", str(f)]) == 2
    assert "key 'max-held': expected an integer" in capsys.readouterr().err


def test_former_held_spellings_still_work_and_warn(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--max-gated and --gate-timeout (and their config keys) became --max-held and
    --hold-timeout: the old ones still set the same fields, with a warning, and stay out
    of the help."""
    new = config(["--max-held", "7", "--hold-timeout", "12"]).settings
    assert "deprecated" not in capsys.readouterr().err
    old = config(["--max-gated", "7", "--gate-timeout", "12"]).settings
    err = capsys.readouterr().err
    for flag, instead in (("--max-gated", "--max-held"), ("--gate-timeout", "--hold-timeout")):
        assert f"mori: {flag} is deprecated and will be removed; use {instead}" in err
    assert old == new and (new.max_held, new.hold_timeout_s) == (7, 12.0)
    f = tmp_path / "old.toml"
    f.write_text("max-gated = 7\ngate_timeout = 12\n")
    assert config(["--config", str(f)]).settings == new
    err = capsys.readouterr().err
    assert "config key 'max-gated'" in err and "use 'max-held'" in err
    assert "config key 'gate_timeout'" in err and "use 'hold-timeout'" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--max-held" in out and "--hold-timeout" in out
    assert "--max-gated" not in out and "--gate-timeout" not in out


def test_mori_serve_command_serves_the_openai_client() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--port", "0",
                             "--time-scale", "50", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = wait_listening(proc)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
            extra_body={"program_id": "cli", "mori": {"prompt_tokens": 5000}})
        assert len((r.choices[0].message.content or "").split()) == 4
        p = httpx.get(f"{url}/v1/programs/cli").json()
        assert p["status"] == "acting" and p["context_tokens"] == 5004
        step = p["last_step"]
        assert step["arrived"] <= step["forwarded"] <= step["finished"]
        assert httpx.get(url + "/healthz").json()["status"] == "ok"
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode in (0, -15)


def test_the_example_config_file_is_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    cfg = config(["--config", str(root / "examples" / "serve.toml")])
    assert cfg.replicas == 2 and cfg.settings.hold_timeout_s == 300.0
    assert cfg.settings.load_interval_s == 1.0
    assert cfg.settings.policy_config.spread_by_load is False


def test_spread_by_load_and_load_interval_from_flags() -> None:
    cfg = config(["--spread-by-load", "--load-interval", "0.5"])
    assert cfg.settings.policy_config.spread_by_load is True
    assert cfg.settings.load_interval_s == 0.5


def test_an_unreachable_engine_at_startup_is_one_clear_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--backend", "sim=http://127.0.0.1:1",
                 "--startup-wait", "0.5", "--port", "0", "--log-level", "error"]) == 1
    err = capsys.readouterr().err
    assert "mori serve: error: cannot read an engine's KV capacity" in err
    assert "127.0.0.1:1" in err
