"""Claude Code and Codex, unmodified, through ``mori serve`` to a real vLLM on the CPU, on
``/v1/messages`` and ``/v1/responses``.

The engine is the tiny random-weight Llama, built for 64k positions (the CLIs' first
prompts are 10-30k tokens: their system prompts and tool schemas) with a KV pool to
match. Its words mean nothing; what is checked is the request flow: each CLI run is one
program of its agent kind, the engine's usage reaches the gateway (the context it
accounts for is the engine's prompt count, not the 4-characters estimate), vLLM served
the agents' own paths, and the recorded trace holds the step. Each CLI runs twice: its
connections served by the policy process, and every one by a worker (``--workers 2``,
``MORI_POLICY_CONNECTIONS=0``).

vLLM needs ``--enable-auto-tool-choice`` (with a tool parser) to take the CLIs' tools,
and Claude Code's extended thinking is turned off (``MAX_THINKING_TOKENS=0``): vLLM
refuses a thinking budget without a reasoning parser.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agents.clis import agent_clis, claude_cmd, claude_env, codex_cmd, codex_env, run_cli
from mori.gateway.worker_process import FLUSH_S
from mori.traces.jsonl import read_traceset
from support.serve_process import stop, wait_listening

from .conftest import VLLMServer, running_vllm

pytestmark = pytest.mark.e2e

MAX_LEN = 65536
BLOCKS = 2100  # x 32 tokens: 67,200, one 64k context and change
SERVED = "tiny"
VIA = ("policy", "workers")
"""Who serves the CLI's connections: the policy process, or a worker."""


@pytest.fixture(scope="module")
def big_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    env = {"MORI_VLLM_MAX_MODEL_LEN": str(MAX_LEN),
           "MORI_VLLM_ARGS": "--enable-auto-tool-choice --tool-call-parser hermes"}
    with running_vllm(tmp_path_factory.mktemp("vllm-agents") / "vllm.log", BLOCKS, MAX_LEN,
                      env) as server:
        yield server


def run_through_mori(vllm: VLLMServer, tmp: Path, which: str, via: str) -> dict[str, Any]:
    clis = agent_clis()
    record = tmp / "rec.jsonl.gz"
    work = tmp / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mori", "serve", "--port", "0",
         "--backend", f"vllm={vllm.url},kv_events={vllm.kv_events}",
         "--model-alias", f"*={SERVED}", "--record", str(record), "--log-level", "warning",
         *(["--workers", "2"] if via == "workers" else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "MORI_POLICY_CONNECTIONS": "0"})
    try:
        url = wait_listening(proc, 120)
        if which == "claude":
            env = {**claude_env(url, tmp / "home", context_tokens=MAX_LEN),
                   "MAX_THINKING_TOKENS": "0"}
            cmd = claude_cmd(clis.claude, "List the files.", model="claude-sonnet-4-5")
        else:
            env = codex_env(url, tmp / "codex", model="gpt-5-codex")
            cmd = codex_cmd(clis.codex, "List the files.", work)
        done = run_cli(cmd, env, work, timeout_s=300)
        rows = httpx.get(url + "/v1/programs").json()["data"]
        time.sleep(2 * FLUSH_S)  # a worker reports its counts twice a second
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop(proc)
    return {"done": done, "rows": rows, "metrics": metrics, "record": record}


def check(out: dict[str, Any], agent: str, path: str, vllm: VLLMServer) -> None:
    done = out["done"]
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [r for r in out["rows"] if not r["anonymous"]]
    assert len(rows) == 1, rows
    (row,) = rows
    assert (row["agent"], row["recogniser"]) == (agent, agent)
    assert row["steps"] >= 1 and row["replica"] == 0
    # the engine's own prompt count came back through the usage fields
    assert 5_000 < row["context_tokens"] < MAX_LEN
    assert f'mori_requests_total{{endpoint="{path}",status="200"}}' in out["metrics"]
    served = [line for line in out["metrics"].splitlines()
              if line.startswith(f'mori_requests_total{{endpoint="{path}"')]
    assert all('status="200"' in line for line in served), served  # the alias applied
    log = vllm.log.read_text(errors="replace")
    assert f'"POST {path} HTTP/1.1" 200' in log
    (prog,) = read_traceset(out["record"]).programs
    assert prog.steps[0].prompt_tokens > 5_000
    assert prog.steps[0].prompt_tokens + prog.steps[0].output_tokens <= row["context_tokens"]


@pytest.mark.parametrize("via", VIA)
def test_claude_code_on_messages(big_vllm: VLLMServer, tmp_path: Path, via: str) -> None:
    check(run_through_mori(big_vllm, tmp_path, "claude", via), "claude-code", "/v1/messages",
          big_vllm)


@pytest.mark.parametrize("via", VIA)
def test_codex_on_responses(big_vllm: VLLMServer, tmp_path: Path, via: str) -> None:
    check(run_through_mori(big_vllm, tmp_path, "codex", via), "codex", "/v1/responses",
          big_vllm)
