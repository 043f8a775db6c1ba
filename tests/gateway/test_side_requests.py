"""Programs that do not linger: a side request (a tool-less one-shot: Claude Code's quota
or title request, token counting) is served and counted but leaves no program behind and
leaves the session's main program as it was; a context left behind when a newer one of
its session begins (a compaction, a ``/clear``) is released after a short grace, not
after ``--program-idle-timeout``, while a context that waits on a subagent is kept; and
Codex's compaction request, which puts its prompt after the last ``function_call_output``,
ends the tool call it follows (tool time measured live)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from gateway_harness import BASH, SHELL, LoopThread
from scripted_gateway import programs, start_scripted

SCRIPT = {"steps": [{"text": "Listing.",
                     "tool": {"Bash": {"command": "ls", "description": "List"},
                              "shell": {"command": ["bash", "-lc", "ls"]}}},
                    {"text": "Done."}]}
SID = "5b9c1f8e-0000-4000-8000-00000000side"
GRACE_S = 0.5
SETTINGS = {"time_scale": 20.0, "abandoned_grace_s": GRACE_S}  # a tick every 0.25 s
CLAUDE = {"x-app": "cli", "User-Agent": "claude-cli/2.1.332 (external, sdk-cli)",
          "X-Claude-Code-Session-Id": SID, "anthropic-version": "2023-06-01",
          "x-api-key": "none"}
AGENT = {"name": "Agent", "description": "Start a subagent",
         "input_schema": {"type": "object", "properties": {"prompt": {"type": "string"}}}}


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str]
         ) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def claude_step(url: str, model: str, system: str, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One main-agent step; the answer is appended to ``messages``."""
    ans = post(url, "/v1/messages", {
        "model": model, "max_tokens": 32000, "system": [{"type": "text", "text": system}],
        "messages": messages, "tools": tools if tools is not None else [BASH]}, CLAUDE)
    messages.append({"role": "assistant", "content": ans["content"]})
    return ans


def tool_result(messages: list[dict[str, Any]], text: str = "a.txt") -> None:
    (use,) = [b for b in messages[-1]["content"] if b["type"] == "tool_use"]
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use["id"], "content": text}]})


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(cond: Any, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()  # type: ignore[no-any-return]


def test_side_requests_leave_no_program_and_do_not_disturb(loop_thread: LoopThread,
                                                          via: str, tmp_path: Path) -> None:
    url, model = start_scripted(loop_thread, tmp_path, via, SCRIPT, **SETTINGS)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    assert claude_step(url, model, "You are Claude Code.", msgs)["stop_reason"] == "tool_use"
    (main,) = programs(url).values()
    # Claude Code's quota check and a title request: tool-less one-shots, same session
    quota = post(url, "/v1/messages", {"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "quota"}]}, CLAUDE)
    assert quota["type"] == "message"
    post(url, "/v1/messages", {"model": model, "max_tokens": 512, "system": "Summarize "
                               "this coding conversation in under 50 characters.",
                               "messages": [{"role": "user", "content": "list the files"}]},
         CLAUDE)
    # and the token counting of the interactive UI: never a program
    n = post(url, "/v1/messages/count_tokens", {"model": model, "messages": msgs}, CLAUDE)
    assert n["input_tokens"] > 0
    rows = programs(url)
    assert list(rows) == [main["program_id"]]  # the main program alone, as it was
    assert rows[main["program_id"]]["in_tool"] == ["Bash"]
    assert rows[main["program_id"]]["steps"] == 1
    # served and counted: the main step, the two side requests, the token count (a
    # worker's counts reach /metrics in batches)
    assert wait_for(lambda: metric(url, "mori_requests_total") == 4)
    # the main turn goes on and ends; a side request then begins no newer context that
    # would leave the main one behind
    tool_result(msgs)
    assert claude_step(url, model, "You are Claude Code.", msgs)["stop_reason"] == "end_turn"
    post(url, "/v1/messages", {"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "quota"}]}, CLAUDE)
    time.sleep(GRACE_S * 3)
    rows = programs(url)
    assert list(rows) == [main["program_id"]] and rows[main["program_id"]]["tool_steps"] == 1


def test_a_context_left_behind_is_released_after_the_grace(loop_thread: LoopThread,
                                                           tmp_path: Path) -> None:
    url, model = start_scripted(loop_thread, tmp_path, "policy", SCRIPT, **SETTINGS)
    old: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    claude_step(url, model, "You are Claude Code.", old)
    tool_result(old)
    claude_step(url, model, "You are Claude Code.", old)  # "Done.": the turn ended
    (old_id,) = programs(url)
    # after a compaction (or /clear): the same session continues in a new context
    new: list[dict[str, Any]] = [{"role": "user", "content": "This session is being "
                                  "continued from a previous conversation that ran out "
                                  "of context. Summary: files listed."}]
    claude_step(url, model, "You are Claude Code.", new)
    rows = programs(url)
    assert len(rows) == 2 and old_id in rows  # not at once: within the grace
    (new_id,) = set(rows) - {old_id}
    assert rows[new_id]["parent"] is None
    assert wait_for(lambda: set(programs(url)) == {new_id}, GRACE_S + 3.0)
    decisions = httpx.get(url + "/v1/decisions").json()["data"]
    assert any(d["kind"] == "release" and d["program_id"] == old_id for d in decisions)


def test_a_context_that_waits_on_its_subagent_is_kept(loop_thread: LoopThread,
                                                      tmp_path: Path) -> None:
    """A main context whose subagent runs in the background (its turn over) and a main
    context in a tool call are not left behind when a subagent begins."""
    script = {"steps": [{"text": "Delegating.",
                         "tool": {"Agent": {"prompt": "find configs"},
                                  "Bash": {"command": "ls"}}},
                        {"text": "Done."}]}
    url, model = start_scripted(loop_thread, tmp_path, "policy", script, **SETTINGS)
    main: list[dict[str, Any]] = [{"role": "user", "content": "explore"}]
    claude_step(url, model, "You are Claude Code.", main, [BASH, AGENT])  # in Agent
    sub_headers = {**CLAUDE, "x-claude-code-agent-id": "a0123456789abcdef"}
    post(url, "/v1/messages", {"model": model, "max_tokens": 32000, "tools": [BASH],
                               "system": "You are an agent for Claude Code.",
                               "messages": [{"role": "user", "content": "find configs"}]},
         sub_headers)
    tool_result(main, "Async agent launched successfully.")
    claude_step(url, model, "You are Claude Code.", main, [BASH, AGENT])  # turn over
    # a second subagent of the session begins while the first is in its tool call
    post(url, "/v1/messages", {"model": model, "max_tokens": 32000, "tools": [BASH],
                               "system": "You are an agent for Claude Code.",
                               "messages": [{"role": "user", "content": "read docs"}]},
         {**CLAUDE, "x-claude-code-agent-id": "afedcba9876543210"})
    time.sleep(GRACE_S * 3)
    rows = programs(url)
    assert len(rows) == 3, rows
    (main_id,) = [pid for pid, r in rows.items() if r["parent"] is None]
    assert rows[main_id]["steps"] == 2 and rows[main_id]["in_tool"] == []


def test_codex_compaction_ends_the_tool_call(loop_thread: LoopThread, via: str,
                                            tmp_path: Path) -> None:
    """Codex compacts right after a tool ran: the compaction request carries the
    ``function_call_output`` and then its prompt, a user message. The tool time is
    measured on it; the window it leaves is then released after the grace."""
    url, model = start_scripted(loop_thread, tmp_path, via, SCRIPT, **SETTINGS)
    turn = {"session_id": "019b-codex", "request_kind": "turn"}
    headers = {"session-id": "019b-codex", "thread-id": "019b-codex",
               "x-codex-window-id": "019b-codex:0", "originator": "codex_exec",
               "User-Agent": "codex_exec/0.171.0 (Linux; x86_64)",
               "x-codex-turn-metadata": json.dumps(turn), "Authorization": "Bearer none"}
    head: list[dict[str, Any]] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context/>"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "list the files"}]}]
    body = {"model": model, "input": head, "tools": [SHELL], "tool_choice": "auto",
            "parallel_tool_calls": True, "store": False, "stream": False,
            "prompt_cache_key": "019b-codex"}
    out = post(url, "/v1/responses", body, headers)
    (fc,) = [o for o in out["output"] if o["type"] == "function_call"]
    time.sleep(0.3)  # the tool runs
    compaction = {**body, "tools": [], "parallel_tool_calls": False, "input": [
        *head, {"type": "function_call", "call_id": fc["call_id"], "name": fc["name"],
                "arguments": fc["arguments"]},
        {"type": "function_call_output", "call_id": fc["call_id"], "output": "a.txt"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text":
         "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary."}]}]}
    post(url, "/v1/responses", compaction,
         {**headers, "x-codex-turn-metadata": json.dumps({**turn,
                                                          "request_kind": "compaction"})})
    (row,) = programs(url).values()
    assert row["program_id"] == "codex:019b-codex/019b-codex:0"
    assert row["steps"] == 2 and row["tool_steps"] == 1 and row["in_tool"] == []
    assert 0.3 <= row["last_tool_s"] < 1.5
    # the turn goes on in the next window; the compacted one is left behind
    post(url, "/v1/responses", {**body, "input": [*head, {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text":
                                                        "Another language model started "
                                                        "to solve this problem..."}]}]},
         {**headers, "x-codex-window-id": "019b-codex:1"})
    assert wait_for(lambda: set(programs(url)) == {"codex:019b-codex/019b-codex:1"},
                    GRACE_S + 3.0)
