"""Program identity with no change to the client: the recognisers, their order, the split
of a session into programs (one growing context each), and the API readings they use."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mori.core.registry import UnknownNameError
from mori.gateway.aliases import ModelAliases
from mori.gateway.identity import (
    DEFAULT_ORDER,
    RECOGNISERS,
    Seen,
    parse_order,
    recognise,
)
from mori.protocol.apis import (
    API_BY_PATH,
    carries_tool_results,
    check_body,
    conversation_head,
    is_side_request,
    last_turn_text,
)
from mori.protocol.errors import RequestError
from mori.protocol.fields import CHAT, COMPLETIONS, MESSAGES, RESPONSES, check_program_id

MSG = API_BY_PATH[MESSAGES]
RESP = API_BY_PATH[RESPONSES]
CHAT_SPEC = API_BY_PATH[CHAT]
SID = "0f3c2a8e-1d2b-4c5d-9e8f-123456789abc"


def claude_body(system: str, first: str, *more: dict[str, Any], user_meta: bool = True
                ) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": first}]}, *more]}
    if user_meta:
        body["metadata"] = {"user_id": json.dumps({"device_id": "d" * 64,
                                                   "session_id": SID})}
    return body


CLAUDE_CLI = {b"x-app": "cli", b"user-agent": "claude-cli/2.1.332 (external, sdk-cli)"}
"""Claude Code's own headers (docs/agents-wire.md), without its session header."""


def seen(body: dict[str, Any], headers: dict[bytes, str] | None = None,
         pid: str | None = None) -> Seen:
    return Seen({**CLAUDE_CLI, **(headers or {})}, body, pid)


def test_claude_code_session_from_header_or_metadata() -> None:
    body = claude_body("You are Claude Code.", "fix the bug")
    by_meta = recognise(DEFAULT_ORDER, MSG, seen(body))
    by_header = recognise(DEFAULT_ORDER, MSG, seen(
        {**body, "metadata": {}}, {b"x-claude-code-session-id": SID}))
    assert by_meta.recogniser == by_header.recogniser == "claude-code"
    assert by_meta.agent == "claude-code" and by_meta.session == SID
    assert by_meta.program_id == by_header.program_id
    assert by_meta.program_id is not None
    assert by_meta.program_id.startswith(f"claude-code:{SID}/")
    # an older CLI's user id: user_<hash>_account__session_<uuid>
    old = {**body, "metadata": {"user_id": f"user_{'a' * 64}_account__session_{SID}"}}
    assert recognise(DEFAULT_ORDER, MSG, seen(old)).session == SID


def test_one_conversation_is_one_program_as_it_grows() -> None:
    first = claude_body("sys", "fix the bug")
    first["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    later = claude_body(
        "sys", "fix the bug",
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                            "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "a\nb", "cache_control": {"type": "x"}}]})
    a = recognise(DEFAULT_ORDER, MSG, seen(first))
    b = recognise(DEFAULT_ORDER, MSG, seen(later))
    assert a.program_id == b.program_id
    assert not carries_tool_results(MSG, first) and carries_tool_results(MSG, later)


def test_a_subagent_or_compacted_conversation_is_another_program_of_the_session() -> None:
    main = recognise(DEFAULT_ORDER, MSG, seen(claude_body("You are Claude Code.", "task")))
    sub = recognise(DEFAULT_ORDER, MSG, seen(claude_body("You are a search agent.",
                                                         "find the config files")))
    compacted = recognise(DEFAULT_ORDER, MSG, seen(claude_body(
        "You are Claude Code.", "This session is being continued... Summary: ...")))
    assert len({main.program_id, sub.program_id, compacted.program_id}) == 3
    assert main.session == sub.session == compacted.session == SID
    # Claude Code 2.1 names its subagents: two with the same prompt are two programs
    named = [recognise(DEFAULT_ORDER, MSG, seen(claude_body("sub", "same task"), {
        b"x-claude-code-agent-id": agent})) for agent in ("a0123", "a4567")]
    assert [r.program_id for r in named] == [f"claude-code:{SID}/a0123",
                                             f"claude-code:{SID}/a4567"]


def test_codex_headers_and_window() -> None:
    body = {"model": "gpt-5-codex", "instructions": "You are Codex.", "stream": True,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "list files"}]}],
            "prompt_cache_key": "pck-1"}
    h = {b"session-id": "s-1", b"x-codex-window-id": "w-7"}
    r = recognise(DEFAULT_ORDER, RESP, seen(body, h))
    assert (r.recogniser, r.agent, r.session, r.program_id) == ("codex", "codex", "s-1",
                                                                "codex:s-1/w-7")
    # without the window header: split by the conversation's head
    r2 = recognise(DEFAULT_ORDER, RESP, seen(body, {b"thread-id": "t-9"}))
    assert r2.session == "t-9" and r2.program_id is not None
    assert r2.program_id.startswith("codex:t-9/")
    # only the body's cache key: the generic OpenAI recogniser
    r3 = recognise(DEFAULT_ORDER, RESP, seen(body))
    assert (r3.recogniser, r3.agent, r3.session) == ("prompt-cache-key", "openai", "pck-1")


def test_explicit_ids_win_and_are_not_split() -> None:
    body = claude_body("sys", "hi")
    r = recognise(DEFAULT_ORDER, MSG, seen(body, {b"x-session-id": "x"}, pid="my-agent"))
    assert (r.program_id, r.recogniser, r.agent) == ("my-agent", "program-id", "client")


def test_order_decides_and_unknown_requests_are_anonymous() -> None:
    body = claude_body("sys", "hi")
    h = {b"x-session-id": "generic-1"}
    r = recognise(("session-header", "claude-code"), MSG, seen(body, h))
    assert (r.recogniser, r.session) == ("session-header", "generic-1")
    r = recognise(("program-id",), MSG, seen(body, h))
    assert r.program_id is None and r.recogniser == "anonymous"
    plain = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert recognise(DEFAULT_ORDER, CHAT_SPEC, seen(plain)).program_id is None


def test_parse_order() -> None:
    assert parse_order("codex, claude-code") == ("codex", "claude-code")
    assert parse_order(["program-id"]) == ("program-id",)
    with pytest.raises(UnknownNameError, match="claude-code"):
        parse_order("claude")
    with pytest.raises(ValueError, match="twice"):
        parse_order("codex,codex")
    with pytest.raises(ValueError, match="at least one"):
        parse_order(" , ")
    assert set(DEFAULT_ORDER) == set(RECOGNISERS.names())


@given(st.text(max_size=400), st.text(max_size=60))
def test_any_session_id_gives_a_valid_program_id(session: str, window: str) -> None:
    """Whatever a client puts in its session headers, the program id is valid (odd ids
    are hashed) and stable."""
    h = {b"session-id": session, b"x-codex-window-id": window}
    body = {"model": "m", "input": "hi"}
    r = recognise(("codex",), RESP, seen(body, h))
    if not session:
        assert r.program_id is None
        return
    assert r.program_id is not None
    check_program_id(r.program_id, 1024)
    assert recognise(("codex",), RESP, seen(body, h)) == r


def test_check_body_per_api() -> None:
    ok = claude_body("s", "hi")
    check_body(MSG, ok)
    for broken, field in ((dict(ok, max_tokens=None), "max_tokens"),
                          (dict(ok, max_tokens=0), "max_tokens"),
                          (dict(ok, messages="hi"), "messages"),
                          (dict(ok, messages=[{"role": 3, "content": "x"}]), "messages[0]"),
                          (dict(ok, messages=[{"role": "user", "content": 5}]),
                           "messages[0].content"),
                          (dict(ok, system=3), "system"),
                          (dict(ok, stream="yes"), "stream")):
        with pytest.raises(RequestError) as e:
            check_body(MSG, broken)
        assert e.value.status == 400 and e.value.param == field
    check_body(RESP, {"model": "m", "input": "hi"})
    check_body(RESP, {"model": "m", "input": [{"type": "message", "role": "user",
                                              "content": "x"}]})
    for broken, field in (({"model": "m", "input": 3}, "input"),
                          ({"model": "m", "input": ["x"]}, "input[0]"),
                          ({"model": "m", "input": "x", "max_output_tokens": -1},
                           "max_output_tokens"),
                          ({"model": "m", "input": "x", "instructions": []}, "instructions"),
                          ({"input": "x"}, "model")):
        with pytest.raises(RequestError) as e:
            check_body(RESP, broken)
        assert e.value.param == field


def test_conversation_readings() -> None:
    body = {"model": "m", "instructions": "be brief",
            "input": [{"type": "message", "role": "developer", "content": "env"},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "task"}]},
                      {"type": "function_call", "name": "shell", "call_id": "c",
                       "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c", "output": "done"}]}
    assert conversation_head(RESP, body) == "be brief\nenv\ntask"
    assert carries_tool_results(RESP, body)
    assert last_turn_text(RESP, body) == "done"
    chat = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                       {"role": "user", "content": "u"},
                                       {"role": "tool", "content": "r", "tool_call_id": "1"}]}
    assert conversation_head(CHAT_SPEC, chat) == "s\nu"
    assert carries_tool_results(CHAT_SPEC, chat)


def test_model_aliases() -> None:
    a = ModelAliases.parse(["claude-*-haiku*=small", "claude-*=big", "gpt-?=big"])
    served = frozenset({"big", "small"})
    assert a.resolve("claude-3-5-haiku-20241022", served) == "small"
    assert a.resolve("claude-sonnet-4-5", served) == "big"
    assert a.resolve("gpt-5", served) == "big"
    assert a.resolve("gpt-55", served) is None
    assert a.resolve("big", served) == "big"
    assert a.resolve("Claude-x", served) is None  # case-sensitive
    for bad in ("claude-*", "=x", "claude-*="):
        with pytest.raises(ValueError, match="PATTERN=SERVED"):
            ModelAliases.parse([bad])


def test_parents_the_clients_name() -> None:
    """Claude Code names a nested subagent's parent agent; Codex a child thread's parent
    thread (whose window number the child does not know: a prefix)."""
    nested = recognise(DEFAULT_ORDER, MSG, seen(claude_body("sub", "deeper"), {
        b"x-claude-code-agent-id": "a2", b"x-claude-code-parent-agent-id": "a1"}))
    assert nested.program_id == f"claude-code:{SID}/a2"
    assert nested.parent == f"claude-code:{SID}/a1"
    top = recognise(DEFAULT_ORDER, MSG, seen(claude_body("sub", "task"),
                                             {b"x-claude-code-agent-id": "a1"}))
    assert top.parent is None  # the main conversation: inferred by the controller
    child = recognise(DEFAULT_ORDER, RESP, seen({"model": "m", "input": "x"}, {
        b"session-id": "s", b"thread-id": "t2", b"x-codex-window-id": "t2:0",
        b"x-codex-parent-thread-id": "t1"}))
    assert (child.program_id, child.parent) == ("codex:s/t2:0", "codex:s/t1:")


OPENCODE_UA = "opencode/1.18.33 ai-sdk/openai-compatible/1.0.30"


def test_opencode_sessions_and_its_subagents_parent_session() -> None:
    """opencode names its session in ``X-Session-Id`` (with ``x-session-affinity``, the
    same ``ses_...``, and its user agent); a subagent is a session of its own that names
    its parent session: the parent is any program of that session."""
    body = {"model": "m", "messages": [{"role": "system", "content": "You are opencode."},
                                       {"role": "user", "content": "go"}]}
    main = recognise(DEFAULT_ORDER, CHAT_SPEC, seen(body, {
        b"user-agent": OPENCODE_UA, b"x-session-id": "ses_a", b"x-session-affinity": "ses_a"}))
    assert (main.recogniser, main.agent, main.session) == ("opencode", "opencode", "ses_a")
    assert main.program_id is not None and main.program_id.startswith("opencode:ses_a/")
    assert main.parent is None and main.parent_session is None
    # without the user agent, the affinity header holding the same ses_ id is enough
    bare = recognise(DEFAULT_ORDER, CHAT_SPEC, seen(body, {
        b"x-session-id": "ses_a", b"x-session-affinity": "ses_a"}))
    assert bare.program_id == main.program_id
    sub = recognise(DEFAULT_ORDER, CHAT_SPEC, seen(body, {
        b"user-agent": OPENCODE_UA, b"x-session-id": "ses_b", b"x-session-affinity": "ses_b",
        b"x-parent-session-id": "ses_a"}))
    assert (sub.session, sub.parent, sub.parent_session) == ("ses_b", "opencode:ses_a/",
                                                             "ses_a")
    # other clients that send X-Session-Id stay clients
    for h in ({b"x-session-id": "run-1"},
              {b"x-session-id": "run-1", b"x-session-affinity": "run-1"},
              {b"x-session-id": "ses_a", b"x-session-affinity": "ses_other"},
              {b"x-session-id": "ses_a", b"user-agent": "python-httpx/0.28"}):
        r = recognise(DEFAULT_ORDER, CHAT_SPEC, seen(body, h))
        assert (r.recogniser, r.agent) == ("session-header", "client"), h


def test_tool_results_anywhere_in_the_new_turns() -> None:
    """Tool results end the tool call wherever they are among the turns after the
    model's last answer: Codex's compaction prompt follows the last
    ``function_call_output``, Claude Code's system reminders a ``tool_result``."""
    head = [{"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "list files"}]}]
    call = {"type": "function_call", "name": "exec_command", "call_id": "c1",
            "arguments": "{\"cmd\": \"ls\"}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "a.txt"}
    compact = {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "You are performing a CONTEXT CHECKPOINT COMPACTION."}]}
    compaction = {"model": "m", "tools": [], "parallel_tool_calls": False,
                  "input": [*head, {"type": "reasoning", "summary": []}, call, output,
                            compact]}
    assert carries_tool_results(RESP, compaction)
    # once the model answered after the results, a new prompt returns none
    answered = {"model": "m", "input": [*head, call, output,
                                        {"type": "message", "role": "assistant", "content": [
                                            {"type": "output_text", "text": "Done."}]},
                                        compact]}
    assert not carries_tool_results(RESP, answered)
    assert not carries_tool_results(RESP, {"model": "m", "input": [*head, call]})
    assert not carries_tool_results(RESP, {"model": "m", "input": head})
    # Anthropic: a system reminder after the tool_result; chat: a user turn after the tool
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                             "input": {}}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                           "content": "ok"}]}
    reminder = {"role": "system", "content": "<system-reminder>todo</system-reminder>"}
    assert carries_tool_results(MSG, claude_body("s", "go", use, result, reminder))
    assert not carries_tool_results(MSG, claude_body("s", "go", use))
    chat = {"model": "m", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                              "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"},
        {"role": "user", "content": "and summarise"}]}
    assert carries_tool_results(CHAT_SPEC, chat)
    chat["messages"].insert(3, {"role": "assistant", "content": "ok"})
    assert not carries_tool_results(CHAT_SPEC, chat)


def test_side_requests_are_tool_less_one_shots() -> None:
    quota = {"model": "m", "max_tokens": 1, "messages": [{"role": "user",
                                                          "content": "quota"}]}
    assert is_side_request(MSG, quota)
    title = {"model": "small", "messages": [
        {"role": "system", "content": "You are a title generator."},
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": "find the config files"}]}
    assert is_side_request(CHAT_SPEC, title)
    assert is_side_request(RESP, {"model": "m", "input": "summarise this"})
    # a step of an agent offers tools; a conversation with an answer in it goes on
    assert not is_side_request(MSG, {**quota, "tools": [{"name": "Bash"}]})
    assert not is_side_request(CHAT_SPEC, {**title, "functions": [{"name": "f"}]})
    assert not is_side_request(MSG, claude_body("s", "go", {"role": "assistant",
                                                           "content": "hi"},
                                                {"role": "user", "content": "more"}))
    assert not is_side_request(RESP, {"model": "m", "input": "go on",
                                      "previous_response_id": "resp_1"})
    # Codex's compaction request offers no tools, but carries the whole conversation
    codex = {"model": "m", "tools": [], "input": [
        {"type": "message", "role": "user", "content": "list"},
        {"type": "function_call", "name": "shell", "call_id": "c", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "a"},
        {"type": "message", "role": "user", "content": "compact"}]}
    assert not is_side_request(RESP, codex)
    tool_result_only = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}
    assert not is_side_request(MSG, tool_result_only)
    assert not is_side_request(API_BY_PATH[COMPLETIONS], {"model": "m", "prompt": "hi"})


def test_readings_take_any_item_values() -> None:
    """A Responses item's role and type are not checked by ``check_body``: values that
    cannot be hashed (a list, an object) are read as no role and no type."""
    odd = {"model": "m", "input": [{"role": ["user"], "type": {"a": 1}, "content": "x"},
                                   {"type": ["function_call_output"], "output": "y"}]}
    check_body(RESP, odd)
    assert not carries_tool_results(RESP, odd)
    assert not is_side_request(RESP, odd)
