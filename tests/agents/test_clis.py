"""clis.py builds an offline environment and command line for each CLI (nothing installed here)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from .clis import (
    claude_cmd,
    claude_env,
    codex_cmd,
    codex_env,
    gemini_cmd,
    gemini_env,
    mini_swe_agent_cmd,
    mini_swe_agent_env,
    opencode_cmd,
    opencode_env,
    qwen_cmd,
    qwen_env,
)


def test_claude_env_is_offline_and_isolated(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "users-token")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    env = claude_env("http://127.0.0.1:9/", tmp_path / "h", context_tokens=100_000)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"
    assert env["HOME"] == str(tmp_path / "h")
    assert env["CLAUDE_CONFIG_DIR"] == str(tmp_path / "h" / ".claude")
    assert (tmp_path / "h" / ".claude").is_dir()
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "100000"
    assert "ANTHROPIC_AUTH_TOKEN" not in env and "HTTPS_PROXY" not in env


def test_claude_cmd_puts_the_variadic_flag_last() -> None:
    cmd = claude_cmd("/x/claude", "list files", model="m", session_id="s", extra=["--verbose"])
    assert cmd[:5] == ["/x/claude", "-p", "list files", "--model", "m"]
    assert cmd[-2:] == ["--allowedTools", "Bash"]
    assert cmd[cmd.index("--session-id") + 1] == "s"


def test_codex_env_writes_a_responses_provider(tmp_path: Path) -> None:
    env = codex_env("http://127.0.0.1:9", tmp_path / "c", model='q"m', auto_compact_tokens=5000)
    cfg = tomllib.loads((tmp_path / "c" / "config.toml").read_text())
    assert cfg["model"] == 'q"m' and cfg["model_provider"] == "mori"
    assert cfg["model_auto_compact_token_limit"] == 5000
    provider = cfg["model_providers"]["mori"]
    assert provider["base_url"] == "http://127.0.0.1:9/v1"
    assert provider["wire_api"] == "responses"
    assert env[provider["env_key"]] and env["CODEX_HOME"] == str(tmp_path / "c")
    # a base URL that already ends in /v1 is kept as it is
    codex_env("http://127.0.0.1:9/v1/", tmp_path / "d")
    cfg = tomllib.loads((tmp_path / "d" / "config.toml").read_text())
    assert cfg["model_providers"]["mori"]["base_url"] == "http://127.0.0.1:9/v1"


def test_codex_cmd_runs_unattended(tmp_path: Path) -> None:
    cmd = codex_cmd("/x/codex", "list files", tmp_path)
    assert cmd[:2] == ["/x/codex", "exec"] and cmd[-1] == "list files"
    assert "--skip-git-repo-check" in cmd
    assert "--dangerously-bypass-approvals-and-sandbox" in cmd
    assert cmd[cmd.index("--cd") + 1] == str(tmp_path)


def test_gemini_env_is_offline_and_isolated(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_API_KEY", "users-key")
    monkeypatch.setenv("GOOGLE_GENAI_USE_VERTEXAI", "true")
    env = gemini_env("http://127.0.0.1:9/", tmp_path / "g")
    assert env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:9"
    assert env["HOME"] == str(tmp_path / "g") and env["GEMINI_API_KEY"]
    assert env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    assert "GOOGLE_API_KEY" not in env and "GOOGLE_GENAI_USE_VERTEXAI" not in env
    settings = json.loads((tmp_path / "g" / ".gemini" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["telemetry"]["enabled"] is False
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["general"]["enableAutoUpdate"] is False


def test_gemini_cmd_runs_headless_and_unattended() -> None:
    cmd = gemini_cmd("/x/gemini", "list files", model="m")
    assert cmd[:5] == ["/x/gemini", "-p", "list files", "-m", "m"]
    assert cmd[cmd.index("--approval-mode") + 1] == "yolo"


def test_opencode_env_writes_an_openai_compatible_provider(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "users-key")
    env = opencode_env("http://127.0.0.1:9/", tmp_path / "o", model="m")
    cfg = json.loads((tmp_path / "o" / "opencode.json").read_text())
    provider = cfg["provider"]["mori"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == "http://127.0.0.1:9/v1"
    assert cfg["model"] == cfg["small_model"] == "mori/m" and "m" in provider["models"]
    assert cfg["permission"]["bash"] == "allow"
    assert env["OPENCODE_CONFIG"] == str(tmp_path / "o" / "opencode.json")
    assert env["npm_config_offline"] == "true" and env["OPENCODE_DISABLE_MODELS_FETCH"]
    assert all(env[k].startswith(str(tmp_path / "o")) for k in env if k.startswith("XDG_"))
    assert "OPENAI_API_KEY" not in env
    assert opencode_cmd("/x/opencode", "go") == ["/x/opencode", "run", "go"]


def test_qwen_env_selects_the_openai_auth(tmp_path: Path) -> None:
    env = qwen_env("http://127.0.0.1:9/v1", tmp_path / "q", model="m", api_key="k")
    settings = json.loads((tmp_path / "q" / ".qwen" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "openai"
    assert settings["general"]["enableAutoUpdate"] is False
    assert (env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"], env["OPENAI_MODEL"]) == (
        "http://127.0.0.1:9/v1", "k", "m")
    assert env["HOME"] == str(tmp_path / "q")
    assert qwen_cmd("/x/qwen", "go") == ["/x/qwen", "go", "--yolo"]


def test_mini_swe_agent_runs_once_against_the_base_url(tmp_path: Path) -> None:
    env = mini_swe_agent_env(tmp_path / "m")
    assert env["MSWEA_CONFIGURED"] == "true" and env["HOME"] == str(tmp_path / "m")
    cmd = mini_swe_agent_cmd("http://127.0.0.1:9", "task", tmp_path / "t.json", model="m")
    assert cmd[cmd.index("-m", 3) + 1] == "openai/m" and cmd[cmd.index("-t") + 1] == "task"
    assert "--exit-immediately" in cmd and "--yolo" in cmd
    assert "model.model_kwargs.api_base=http://127.0.0.1:9/v1" in cmd
