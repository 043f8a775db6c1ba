"""The real agent CLIs, run offline against a local endpoint.

``agent_clis()`` installs Claude Code, Codex, Gemini CLI, opencode and Qwen Code at the
versions pinned in ``tests/agents/package-lock.json`` (``scripts/agent_clis.sh``, cached
under ``${MORI_CACHE:-~/.cache/mori}/agent-clis/``; about 40 s cold, well under a second
warm) once per process and returns the paths of the executables. It skips the calling
test only where ``node`` or ``npm`` is missing; any other failure fails it with the
script's output.

The other functions build what each CLI needs to run non-interactively, offline, with a
throwaway home so that nothing of the user's configuration is read:

    env = claude_env("http://127.0.0.1:PORT", tmp_path / "claude-home")
    run_cli(claude_cmd(clis.claude, "list the files"), env, workdir)

    env = codex_env("http://127.0.0.1:PORT", tmp_path / "codex-home", model="m")
    run_cli(codex_cmd(clis.codex, "list the files", workdir), env, workdir)

    env = gemini_env("http://127.0.0.1:PORT", tmp_path / "gemini-home")
    run_cli(gemini_cmd(clis.gemini, "list the files"), env, workdir)

    env = opencode_env("http://127.0.0.1:PORT", tmp_path / "opencode-home", model="m")
    run_cli(opencode_cmd(clis.opencode, "list the files"), env, workdir)

    env = qwen_env("http://127.0.0.1:PORT", tmp_path / "qwen-home", model="m")
    run_cli(qwen_cmd(clis.qwen, "list the files"), env, workdir)

The Python clients (mini-swe-agent, the openai-agents SDK) come with the ``test`` extra;
``mini_swe_agent_cmd`` and ``mini_swe_agent_env`` run the first the same way.

What each CLI then sends (paths, headers, session ids, tools, compaction) is measured in
docs/agents-wire.md.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "agent_clis.sh"
INSTALL_TIMEOUT_S = 900
DEFAULT_MODEL = "mori-test"
DEFAULT_API_KEY = "mori-local-key"
CODEX_PROVIDER = "mori"
CODEX_KEY_ENV = "MORI_API_KEY"
# Passed through from the caller's environment; everything else is left out so that no
# ANTHROPIC_* / OPENAI_* / proxy setting of the user's reaches the CLIs.
_PASS_THROUGH = ("PATH", "LANG", "LC_ALL", "TMPDIR", "TZ")


@dataclass(frozen=True)
class AgentCLIs:
    """Paths of the installed CLIs (all in the cached install's ``node_modules/.bin``)."""

    bin_dir: Path
    claude: Path
    codex: Path
    gemini: Path
    opencode: Path
    qwen: Path


@dataclass(frozen=True)
class _Outcome:
    clis: AgentCLIs | None = None
    skip: str = ""
    fail: str = ""


def agent_clis() -> AgentCLIs:
    """Install (or reuse) the pinned CLIs, once per process, and return their paths.

    Skips the calling test where ``node`` or ``npm`` is not installed; fails it, with the
    installer's output tail, on any other problem (the registry unreachable included).
    """
    outcome = _install()
    if outcome.skip:
        pytest.skip(outcome.skip)
    if outcome.fail:
        pytest.fail(outcome.fail, pytrace=False)
    assert outcome.clis is not None
    return outcome.clis


@functools.cache
def _install() -> _Outcome:
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        return _Outcome(skip=f"{' and '.join(missing)} not installed: the agent-CLI tests "
                             "need Node.js 20+ and npm (scripts/agent_clis.sh)")
    try:
        proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return _Outcome(fail=f"scripts/agent_clis.sh took over {INSTALL_TIMEOUT_S} s "
                             f"(npm registry slow or unreachable?):\n{_tail(exc.stderr)}")
    tail = _tail((proc.stderr or "") + (proc.stdout or ""))
    if proc.returncode == 3:
        return _Outcome(skip=f"node or npm not usable (scripts/agent_clis.sh):\n{tail}")
    if proc.returncode != 0:
        why = " (an npm step failed: registry unreachable?)" if proc.returncode == 2 else ""
        return _Outcome(fail=f"scripts/agent_clis.sh failed with exit {proc.returncode}"
                             f"{why}:\n{tail}")
    lines = proc.stdout.strip().splitlines()
    bin_dir = Path(lines[-1]) if lines else Path()
    clis = AgentCLIs(bin_dir, bin_dir / "claude", bin_dir / "codex", bin_dir / "gemini",
                     bin_dir / "opencode", bin_dir / "qwen")
    for exe in (clis.claude, clis.codex, clis.gemini, clis.opencode, clis.qwen):
        if not os.access(exe, os.X_OK):
            return _Outcome(fail=f"scripts/agent_clis.sh reported {bin_dir}, but {exe} is not "
                                 f"an executable:\n{tail}")
    return _Outcome(clis=clis)


def _tail(text: str | bytes | None, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def _base_env() -> dict[str, str]:
    return {k: os.environ[k] for k in _PASS_THROUGH if k in os.environ}


# ------------------------------------------------------------------ Claude Code


def claude_env(base_url: str, home: Path, *, api_key: str = DEFAULT_API_KEY,
               context_tokens: int | None = None) -> dict[str, str]:
    """The environment for ``claude -p`` against ``base_url`` (the server root, no ``/v1``).

    ``home`` (created) becomes both ``HOME`` and, as ``home/.claude``, ``CLAUDE_CONFIG_DIR``,
    so no configuration, credentials or session of the user's is read. The key goes in
    ``x-api-key``. ``context_tokens`` sets the context window Claude Code assumes
    (``CLAUDE_CODE_MAX_CONTEXT_TOKENS``; it otherwise assumes 1M tokens for a model name it
    does not know), so a test can make it auto-compact with a small reported usage.
    """
    home.mkdir(parents=True, exist_ok=True)
    (home / ".claude").mkdir(exist_ok=True)
    env = _base_env()
    env.update({
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "ANTHROPIC_BASE_URL": base_url.rstrip("/"),
        "ANTHROPIC_API_KEY": api_key,
        # no update checks, telemetry, error reports, connectivity probe (HEAD /api/hello)
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    })
    if context_tokens is not None:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(context_tokens)
    return env


def claude_cmd(claude: Path | str, prompt: str, *, model: str = DEFAULT_MODEL,
               allowed_tools: Sequence[str] = ("Bash",), session_id: str | None = None,
               resume: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``claude -p PROMPT --model MODEL [...] --allowedTools Bash``.

    ``-p`` skips the trust dialog and onboarding; ``--allowedTools Bash`` lets the model run
    any shell command without a permission prompt, as root too (where
    ``--dangerously-skip-permissions`` is refused unless ``IS_SANDBOX=1``). Without it only
    read-only commands run; others come back to the model as a permission error.
    ``session_id`` fixes the session id (a UUID); ``resume`` continues a session kept in
    the same home. ``--allowedTools`` takes several values, so it comes last.
    """
    cmd = [str(claude), "-p", prompt, "--model", model]
    if session_id:
        cmd += ["--session-id", session_id]
    if resume:
        cmd += ["--resume", resume]
    cmd += list(extra)
    if allowed_tools:
        cmd += ["--allowedTools", *allowed_tools]
    return cmd


# ------------------------------------------------------------------ Codex


def codex_env(base_url: str, codex_home: Path, *, model: str = DEFAULT_MODEL,
              api_key: str = DEFAULT_API_KEY, auto_compact_tokens: int | None = None,
              context_window: int | None = None) -> dict[str, str]:
    """Write ``codex_home/config.toml`` for ``base_url`` and return the environment for Codex.

    ``base_url`` is the server root (``/v1`` is appended unless already there). The config
    selects a provider ``mori`` speaking the Responses API (``wire_api = "responses"``) with
    the key read from ``$MORI_API_KEY`` (sent as ``Authorization: Bearer``), model
    ``model``, no approvals, no sandbox (the commands run as the test user), no analytics
    and no update check. ``auto_compact_tokens`` sets ``model_auto_compact_token_limit``
    (Codex compacts once a response's reported usage passes it); ``context_window`` sets
    ``model_context_window``. ``HOME`` is ``codex_home/home`` so nothing of the user's is
    read.
    """
    url = base_url.rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "home").mkdir(exist_ok=True)
    lines = [
        f"model = {_toml_str(model)}",
        f'model_provider = "{CODEX_PROVIDER}"',
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
    ]
    if auto_compact_tokens is not None:
        lines.append(f"model_auto_compact_token_limit = {int(auto_compact_tokens)}")
    if context_window is not None:
        lines.append(f"model_context_window = {int(context_window)}")
    lines += [
        "",
        "[analytics]",
        "enabled = false",
        "",
        f"[model_providers.{CODEX_PROVIDER}]",
        'name = "MORI"',
        f"base_url = {_toml_str(url)}",
        'wire_api = "responses"',
        f'env_key = "{CODEX_KEY_ENV}"',
        "",
    ]
    (codex_home / "config.toml").write_text("\n".join(lines))
    env = _base_env()
    env.update({
        "HOME": str(codex_home / "home"),
        "CODEX_HOME": str(codex_home),
        CODEX_KEY_ENV: api_key,
    })
    return env


def codex_cmd(codex: Path | str, prompt: str, workdir: Path | str, *,
              extra: Sequence[str] = ()) -> list[str]:
    """``codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox ...``.

    ``--skip-git-repo-check`` lets it run outside a git repository; the bypass flag (also
    set in config.toml by ``codex_env``) runs shell commands unsandboxed and unasked, which
    works as root in a container. ``-s workspace-write`` works here too (Codex falls back
    to its bundled bubblewrap), the default ``read-only`` sandbox refuses writes.
    """
    return [str(codex), "exec", "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox", "--color", "never",
            "--cd", str(workdir), *extra, prompt]


def _toml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _v1(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# ------------------------------------------------------------------ Gemini CLI


GEMINI_SETTINGS = {
    # the Gemini API with a key; GOOGLE_GEMINI_BASE_URL alone would select the "gateway"
    # auth type, which 0.61.0's non-interactive check refuses ("Invalid auth method")
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "ide": {"enabled": False},
}
"""``~/.gemini/settings.json`` for a run offline: no update check, usage statistics,
telemetry or IDE connection."""


def gemini_env(base_url: str, home: Path, *, api_key: str = DEFAULT_API_KEY
               ) -> dict[str, str]:
    """Write ``home/.gemini/settings.json`` (``GEMINI_SETTINGS``) and return the
    environment for ``gemini -p`` against ``base_url`` (the server root: the Gemini
    SDK adds ``/v1beta/models/...``).

    ``home`` (created) is ``HOME``, so nothing of the user's is read. The key is
    ``GEMINI_API_KEY`` (sent as ``x-goog-api-key``), the server ``GOOGLE_GEMINI_BASE_URL``;
    ``GEMINI_CLI_TRUST_WORKSPACE=true`` trusts the working folder (headless runs refuse
    an untrusted one).
    """
    (home / ".gemini").mkdir(parents=True, exist_ok=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(GEMINI_SETTINGS, indent=2))
    env = _base_env()
    env.update({
        "HOME": str(home),
        "GEMINI_API_KEY": api_key,
        "GOOGLE_GEMINI_BASE_URL": base_url.rstrip("/"),
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
        "NO_COLOR": "1",
    })
    return env


def gemini_cmd(gemini: Path | str, prompt: str, *, model: str = DEFAULT_MODEL,
               extra: Sequence[str] = ()) -> list[str]:
    """``gemini -p PROMPT -m MODEL --approval-mode yolo``: headless, every tool call
    approved (shell commands run unasked)."""
    return [str(gemini), "-p", prompt, "-m", model, "--approval-mode", "yolo", *extra]


# ------------------------------------------------------------------ opencode


OPENCODE_PROVIDER = "mori"


def opencode_env(base_url: str, home: Path, *, model: str = DEFAULT_MODEL,
                 api_key: str = DEFAULT_API_KEY) -> dict[str, str]:
    """Write ``home/opencode.json`` for ``base_url`` and return the environment for
    ``opencode run``.

    The config declares a provider ``mori`` on ``@ai-sdk/openai-compatible`` (bundled in
    the binary: chat completions at ``base_url``/v1, the key as ``Authorization:
    Bearer``), with ``model`` as both the model and the ``small_model`` (its title
    requests), and allows the bash and edit tools without asking. ``HOME`` and the XDG
    folders are under ``home``; the update check, the models.dev fetch, LSP downloads,
    the default plugins and sharing are off, and npm is told to stay offline (opencode
    otherwise installs ``@opencode-ai/plugin`` into its config folder in the background).
    """
    home.mkdir(parents=True, exist_ok=True)
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {OPENCODE_PROVIDER: {
            "npm": "@ai-sdk/openai-compatible", "name": "MORI",
            "options": {"baseURL": _v1(base_url), "apiKey": api_key},
            "models": {model: {"name": model}}}},
        "model": f"{OPENCODE_PROVIDER}/{model}",
        "small_model": f"{OPENCODE_PROVIDER}/{model}",
        "autoupdate": False, "share": "disabled",
        "permission": {"bash": "allow", "edit": "allow"},
    }
    (home / "opencode.json").write_text(json.dumps(config, indent=1))
    env = _base_env()
    env.update({
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_DATA_HOME": str(home / "data"),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_STATE_HOME": str(home / "state"),
        "OPENCODE_CONFIG": str(home / "opencode.json"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "npm_config_offline": "true",
    })
    return env


def opencode_cmd(opencode: Path | str, prompt: str) -> list[str]:
    """``opencode run PROMPT``: one prompt, non-interactive, in the working folder."""
    return [str(opencode), "run", prompt]


# ------------------------------------------------------------------ Qwen Code


def qwen_env(base_url: str, home: Path, *, model: str = DEFAULT_MODEL,
             api_key: str = DEFAULT_API_KEY) -> dict[str, str]:
    """Write ``home/.qwen/settings.json`` and return the environment for ``qwen``.

    Qwen Code speaks chat completions to ``OPENAI_BASE_URL`` (``base_url``/v1) with
    ``OPENAI_API_KEY`` and ``OPENAI_MODEL``, once the settings select the ``openai`` auth
    type; they also turn off the update check, usage statistics and telemetry. ``HOME``
    is ``home``.
    """
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    settings = {"security": {"auth": {"selectedType": "openai"}},
                "general": {"enableAutoUpdate": False},
                "privacy": {"usageStatisticsEnabled": False},
                "telemetry": {"enabled": False}}
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings, indent=1))
    env = _base_env()
    env.update({
        "HOME": str(home),
        "OPENAI_BASE_URL": _v1(base_url),
        "OPENAI_API_KEY": api_key,
        "OPENAI_MODEL": model,
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    })
    return env


def qwen_cmd(qwen: Path | str, prompt: str) -> list[str]:
    """``qwen PROMPT --yolo``: one prompt, non-interactive, every tool call allowed.

    Qwen Code refuses a shell command that sleeps and then does something else
    (``sleep 2 && ls``): a deliberate sleep must stand alone, marked ``sleep 2 #
    intentional-sleep: REASON``."""
    return [str(qwen), prompt, "--yolo"]


# ------------------------------------------------------------------ mini-swe-agent


def mini_swe_agent_env(home: Path) -> dict[str, str]:
    """The environment for ``mini``: ``HOME`` and its config folder under ``home``, the
    first-run setup skipped (``MSWEA_CONFIGURED``), cost tracking that tolerates a model
    litellm does not price, and litellm's bundled cost map (no download)."""
    home.mkdir(parents=True, exist_ok=True)
    env = _base_env()
    env.update({
        "HOME": str(home),
        "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent"),
        "MSWEA_CONFIGURED": "true",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    })
    return env


def mini_swe_agent_cmd(base_url: str, task: str, trajectory: Path, *,
                       model: str = DEFAULT_MODEL,
                       api_key: str = DEFAULT_API_KEY) -> list[str]:
    """``mini -m openai/MODEL -t TASK --yolo --exit-immediately`` against ``base_url``/v1.

    litellm's ``openai/`` prefix sends chat completions to ``api_base``; ``--yolo`` runs
    the ``bash`` tool's commands unasked; ``--exit-immediately`` ends the run when the
    agent submits (a command printing ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``) instead
    of asking for a new task on stdin (``run_cli`` closes stdin too)."""
    return [sys.executable, "-m", "minisweagent", "-m", f"openai/{model}", "-t", task,
            "--yolo", "--exit-immediately", "--cost-limit", "0",
            "-o", str(trajectory), "-c", "mini.yaml",
            "-c", f"model.model_kwargs.api_base={_v1(base_url)}",
            "-c", f"model.model_kwargs.api_key={api_key}"]


# ------------------------------------------------------------------ running


def run_cli(cmd: Sequence[str], env: Mapping[str, str], cwd: Path | str,
            timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run a CLI to completion with stdin closed (``codex exec`` reads a piped stdin)."""
    return subprocess.run(list(cmd), env=dict(env), cwd=str(cwd), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
