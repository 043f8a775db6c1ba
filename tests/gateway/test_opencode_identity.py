"""opencode through the gateway, its requests as opencode sends them (the
openai-compatible provider: ``User-Agent: opencode/...``, ``X-Session-Id`` and
``x-session-affinity`` holding the session's ``ses_...`` id, a subagent's
``x-parent-session-id``): one program per session, agent ``opencode``, the subagent's
parent set, its title request no program that stays; and another client that sends
``X-Session-Id`` stays a ``client``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from gateway_harness import LoopThread
from scripted_gateway import programs, start_scripted

SCRIPT = {"steps": [{"text": "Working on it.",
                     "tool": {"task": {"description": "Find configs", "prompt": "find them",
                                       "subagent_type": "general"},
                              "bash": {"command": "ls", "description": "List files"}}},
                    {"text": "Done."}]}
UA = "opencode/1.18.33 ai-sdk/openai-compatible/1.0.30 runtime/bun/1.3.4"
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                    "description": {"type": "string"}},
                   "required": ["command", "description"]}}}
TASK = {"type": "function", "function": {
    "name": "task", "description": "Start a subagent",
    "parameters": {"type": "object", "properties": {"prompt": {"type": "string"}}}}}
TITLE_SYSTEM = "You are a title generator. You output ONLY a thread title. Nothing else."


def opencode_headers(session: str, parent: str | None = None) -> dict[str, str]:
    h = {"User-Agent": UA, "x-session-affinity": session, "X-Session-Id": session,
         "Authorization": "Bearer none"}
    if parent is not None:
        h["x-parent-session-id"] = parent
    return h


def chat(url: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_opencode_session_subagent_and_title(loop_thread: LoopThread, via: str,
                                            tmp_path: Path) -> None:
    url, model = start_scripted(loop_thread, tmp_path, via, SCRIPT)
    main_msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are opencode, an interactive CLI tool."},
        {"role": "user", "content": "find the config files"}]
    main = chat(url, opencode_headers("ses_7a1f0c2e9b3dQx4LmN8pR2sT5u"),
                {"model": model, "max_tokens": 32000, "messages": main_msgs,
                 "tools": [BASH, TASK], "tool_choice": "auto", "stream": False})
    (call,) = main["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "task"
    # the title request opencode sends beside the first step: to its small model, no tools
    title = chat(url, opencode_headers("ses_7a1f0c2e9b3dQx4LmN8pR2sT5u"), {
        "model": model, "max_tokens": 32000, "stream": False, "messages": [
            {"role": "system", "content": TITLE_SYSTEM},
            {"role": "user", "content": "Generate a title for this conversation:\n"},
            {"role": "user", "content": "find the config files"}]})
    assert title["choices"][0]["message"]["content"]
    # the subagent: a session of its own that names its parent session
    sub_headers = opencode_headers("ses_7a1f0c30a1b2Zy9KjH7gF6dS4a",
                                   parent="ses_7a1f0c2e9b3dQx4LmN8pR2sT5u")
    sub_msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a subagent of opencode."},
        {"role": "user", "content": "find them"}]
    sub = chat(url, sub_headers, {"model": model, "max_tokens": 32000, "messages": sub_msgs,
                                  "tools": [BASH], "stream": False})
    (sub_call,) = sub["choices"][0]["message"]["tool_calls"]
    assert sub_call["function"]["name"] == "bash"
    time.sleep(0.3)  # the subagent's tool runs
    sub_msgs += [{"role": "assistant", "content": None, "tool_calls": [sub_call]},
                 {"role": "tool", "tool_call_id": sub_call["id"], "content": "a.toml"}]
    chat(url, sub_headers, {"model": model, "max_tokens": 32000, "messages": sub_msgs,
                            "tools": [BASH], "stream": False})

    rows = programs(url)
    assert len(rows) == 2, rows  # the title request left no program behind
    by_session = {r["session"]: r for r in rows.values()}
    parent = by_session["ses_7a1f0c2e9b3dQx4LmN8pR2sT5u"]
    child = by_session["ses_7a1f0c30a1b2Zy9KjH7gF6dS4a"]
    for r in (parent, child):
        assert (r["agent"], r["recogniser"]) == ("opencode", "opencode")
    assert parent["program_id"].startswith("opencode:ses_7a1f0c2e9b3dQx4LmN8pR2sT5u/")
    assert parent["parent"] is None and parent["in_tool"] == ["task"]
    assert parent["steps"] == 1  # the title request was not a step of it
    assert child["parent"] == parent["program_id"]
    assert child["steps"] == 2 and child["tool_steps"] == 1
    assert 0.3 <= child["last_tool_s"] < 1.5


def test_other_clients_sending_x_session_id_stay_clients(loop_thread: LoopThread,
                                                         tmp_path: Path) -> None:
    url, model = start_scripted(loop_thread, tmp_path, "policy", SCRIPT)
    body = {"model": model, "messages": [{"role": "user", "content": "go"}],
            "tools": [BASH], "stream": False}
    chat(url, {"X-Session-Id": "run-1", "User-Agent": "python-httpx/0.28"}, body)
    # an affinity header alone is no opencode mark unless it holds opencode's session id
    chat(url, {"X-Session-Id": "run-2", "x-session-affinity": "run-2"}, body)
    rows = programs(url)
    assert {r["session"] for r in rows.values()} == {"run-1", "run-2"}
    for r in rows.values():
        assert (r["agent"], r["recogniser"]) == ("client", "session-header")
