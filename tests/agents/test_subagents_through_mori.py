"""Subagents a script starts, through ``mori serve --engine-script``: Codex's
``spawn_agent`` and Claude Code's background ``Agent``.

Codex offers its subagent tools inside a Responses ``namespace`` tool
(``multi_agent_v1``): the script calls ``spawn_agent`` (the answer names the namespace),
the child runs ``sleep 2 && ls`` with ``exec_command``, and the parent waits on it with
``wait_agent``, whose target the script fills from ``spawn_agent``'s result
(``{{result.agent_id}}``). Claude Code runs an ``Agent`` call in the background unless
told otherwise and, when the subagent ends, tells the main agent in a new user turn
holding a ``<task-notification>``: the script goes on from there instead of starting
over (it would start the subagent again, and again). In both, the subagent is a program
of its own whose parent is the main agent's, its ``sleep`` is measured on the wire, and
the CLI exits 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .clis import agent_clis, claude_cmd, claude_env, codex_cmd, codex_env
from .gateway_runs import (
    SLEEP_S,
    GatewayRun,
    measured,
    near_sleep,
    run_through_gateway,
    tool_gaps,
)

pytestmark = pytest.mark.e2e

SHELL = f"sleep {SLEEP_S:g} && ls"
MARKER = "marker-file.txt"
TASK = "List the files here."

CODEX_SCRIPT = {"steps": [
    # the child is not offered multi_agent_v1: it runs the shell command
    {"text": "Asking a helper.",
     "tool": {"spawn_agent": {"message": TASK}, "exec_command": {"cmd": SHELL}}},
    {"text": "Waiting for the helper.",
     "tool": {"wait_agent": {"targets": ["{{result.agent_id}}"], "timeout_ms": 30000}}},
    {"text": "Done."}], "fallback": "OK."}

CLAUDE_SCRIPT = {"steps": [
    # the main agent (offered ScheduleWakeup) starts a background subagent; the subagent,
    # offered Agent too but not ScheduleWakeup, runs Bash
    {"text": "Asking a helper.", "requires": {"Agent": ["ScheduleWakeup"]},
     "tool": {"Agent": {"description": "Look around", "prompt": TASK,
                        "subagent_type": "general-purpose"},
              "Bash": {"command": SHELL, "description": "List the files"}}},
    {"text": "Done."}], "fallback": "OK."}


def workdir(tmp: Path) -> Path:
    work = tmp / "work"
    work.mkdir()
    (work / MARKER).write_text("x")
    return work


def main_and_sub(run: GatewayRun, agent: str) -> tuple[dict[str, object], dict[str, object]]:
    """The session's two programs, each its own, the subagent's parent the main one's."""
    rows = run.programs
    assert {(r["agent"], r["recogniser"]) for r in rows} == {(agent, agent)}, rows
    assert len(rows) == 2 and len({r["session"] for r in rows}) == 1, rows
    (main,) = [r for r in rows if r["parent"] is None]
    (sub,) = [r for r in rows if r["parent"] is not None]
    assert sub["parent"] == main["program_id"] != sub["program_id"]
    (top,) = run.top_level()  # recorded with the subagent nested below its parent's step
    assert top.name == main["program_id"]
    assert [sp.program.name for s in top.steps for sp in s.subagents] == [sub["program_id"]]
    return main, sub


def test_codex_spawns_a_subagent_that_is_its_own_program(tmp_path: Path) -> None:
    clis = agent_clis()
    work = workdir(tmp_path)
    run = run_through_gateway(
        tmp_path, CODEX_SCRIPT,
        lambda url: (codex_cmd(clis.codex, TASK, work),
                     codex_env(url, tmp_path / "codex-home", model="gpt-5-codex")),
        work)
    assert run.returncode == 0, run.tail()
    assert "Done." in run.output
    main, sub = main_and_sub(run, "codex")
    assert main["tools"] == {"spawn_agent": 1, "wait_agent": 1}, main
    assert sub["tools"] == {"exec_command": 1} and sub["tool_steps"] == 1, sub
    assert isinstance(sub["tool_s"], float) and near_sleep(sub["tool_s"]), sub
    # the parent waited on the child it spawned: its wait took the child's sleep
    (parent,) = [p for p in run.traces() if p.name == main["program_id"]]
    assert len(parent.steps) == 3  # spawn, wait, the final answer after the notification
    (child,) = [p for p in run.traces() if p.name == sub["program_id"]]
    assert near_sleep(tool_gaps(child, "exec_command")[0])
    assert any(MARKER in t for t in run.texts())
    measured(run, "Codex, spawn_agent child", [sub["tool_s"]])


def test_claude_code_background_agent_completes(tmp_path: Path) -> None:
    clis = agent_clis()
    work = workdir(tmp_path)
    run = run_through_gateway(
        tmp_path, CLAUDE_SCRIPT,
        lambda url: (claude_cmd(clis.claude, TASK, model="claude-sonnet-4-5"),
                     claude_env(url, tmp_path / "claude-home")),
        work)
    assert run.returncode == 0, run.tail()
    assert "Done." in run.output
    main, sub = main_and_sub(run, "claude-code")
    assert main["tools"] == {"Agent": 1}, main  # started once: no loop
    assert sub["tools"] == {"Bash": 1} and sub["tool_steps"] == 1, sub
    assert isinstance(sub["tool_s"], float) and near_sleep(sub["tool_s"]), sub
    # in the background: the Agent call's result (the launch) came back at once, and the
    # subagent's end came as one more prompt (the notification), answered with the script's
    # last text
    assert isinstance(main["tool_s"], float) and main["tool_s"] < SLEEP_S / 2, main
    (parent,) = [p for p in run.traces() if p.name == main["program_id"]]
    assert len(parent.steps) == 3, parent.steps
    assert any("<task-notification>" in t for t in run.texts())
    assert any(MARKER in t for t in run.texts())
    measured(run, "Claude Code, background Agent's subagent", [sub["tool_s"]])
