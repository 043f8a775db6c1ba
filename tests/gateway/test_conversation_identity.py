"""Programs of clients that name no session, told apart by the conversation itself
(``mori.gateway.conversations``): the index alone, then the ``openai`` and ``anthropic``
SDKs against ``mori serve`` with a scripted simulated engine, as Qwen Code, aider,
mini-swe-agent and the plain SDKs reach it. Also: the ``anthropic`` SDK's
``metadata.user_id`` without Claude Code's own headers is no Claude Code program."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from gateway_harness import LoopThread

from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.conversations import ConversationIndex
from mori.gateway.identity import DEFAULT_ORDER, Seen, recognise
from mori.gateway.server import ServeConfig, start_simulated_backends
from mori.protocol.apis import API_BY_PATH
from mori.protocol.fields import CHAT, MESSAGES, RESPONSES
from mori.traces.jsonl import read_traceset
from mori.traces.model import GapKind

CHAT_SPEC, MSG, RESP = API_BY_PATH[CHAT], API_BY_PATH[MESSAGES], API_BY_PATH[RESPONSES]
SCRIPT = {"steps": [
    {"text": "Listing.", "tool": {"bash": {"command": "ls"}, "Bash": {"command": "ls"}}},
    {"text": "Done."}]}
BASH_FN = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}
BASH_TOOL = {"name": "Bash", "description": "Run a shell command",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                              "required": ["command"]}}


# -- the index ------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def chat(*turns: dict[str, Any], system: str = "You are a helpful agent.") -> dict[str, Any]:
    return {"model": "m", "tools": [BASH_FN],
            "messages": [{"role": "system", "content": system}, *turns]}


USER = {"role": "user", "content": "list the files"}


def answer(call: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call, "type": "function",
         "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}


def result(call: str, out: str = "a.txt") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call, "content": out}


def step(idx: ConversationIndex, spec: Any, body: dict[str, Any], namespace: str = ""
         ) -> str | None:
    """One request's program, its request then ended (the next may continue it)."""
    pid = idx.program(spec, body, namespace)
    if pid is not None:
        idx.done(namespace, pid)
    return pid


def test_a_conversation_that_grows_is_one_program() -> None:
    idx = ConversationIndex()
    first = step(idx, CHAT_SPEC, chat(USER))
    second = step(idx, CHAT_SPEC, chat(USER, answer("c1"), result("c1")))
    third = step(idx, CHAT_SPEC, chat(USER, answer("c1"), result("c1"), answer("c2"),
                                        result("c2"), {"role": "user", "content": "more"}))
    assert first is not None and first.startswith("conv:")
    assert first == second == third and len(idx) == 1
    # a retry of the last request: the same program
    assert step(idx, CHAT_SPEC, chat(USER, answer("c1"), result("c1"), answer("c2"),
                                       result("c2"), {"role": "user", "content": "more"})
                       ) == first


def test_other_conversations_and_non_extensions_are_new_programs() -> None:
    idx = ConversationIndex()
    a = step(idx, CHAT_SPEC, chat(USER))
    b = step(idx, CHAT_SPEC, chat({"role": "user", "content": "other task"}))
    assert a != b
    step(idx, CHAT_SPEC, chat(USER, answer("c1"), result("c1")))
    # the same start, but not an extension of a's last prompt (another answer before):
    # another conversation with a's start, so a's id with a suffix
    forked = step(idx, CHAT_SPEC, chat(USER, answer("zz"), result("zz")))
    assert forked is not None and a is not None
    assert forked != a and forked.startswith(a + ".")
    # a rewritten history (an earlier turn changed) is no extension either
    rewritten = step(idx, CHAT_SPEC, chat(USER, answer("c1"), result("c1", "changed"),
                                            answer("c2"), result("c2")))
    assert rewritten not in (a, b, forked)


def test_a_busy_program_is_not_continued_by_another_request() -> None:
    """A program has one request at a time: the same conversation sent twice at once (as a
    load generator sends one body on many connections) is two programs, never a request
    that waits on the other; once a request ends, its program is continued again."""
    idx = ConversationIndex()
    a = idx.program(CHAT_SPEC, chat(USER))
    b = idx.program(CHAT_SPEC, chat(USER))  # a's request still runs
    assert a is not None and b is not None and b != a and b.startswith(a + ".")
    idx.done("", a)
    assert idx.program(CHAT_SPEC, chat(USER)) == a  # a retry of a's request, a free
    idx.done("", a)
    idx.done("", b)
    # both go on; identical until here, either's next step may continue either program
    nxt = chat(USER, answer("c1"), result("c1"))
    first, second = idx.program(CHAT_SPEC, nxt), idx.program(CHAT_SPEC, nxt)
    assert {first, second} == {a, b}
    # all busy: a third copy starts a program of its own
    third = idx.program(CHAT_SPEC, nxt)
    assert third not in (a, b) and len(idx) == 3


def test_namespaces_never_share_a_program() -> None:
    idx = ConversationIndex()
    a = step(idx, CHAT_SPEC, chat(USER), "key-a")
    b = step(idx, CHAT_SPEC, chat(USER), "key-b")
    assert a == b  # the same id as each key names it ...
    # ... and each goes on in its own namespace
    assert step(idx, CHAT_SPEC, chat(USER, answer("c1"), result("c1")), "key-b") == b
    assert len(idx) == 2


def test_moved_cache_marks_do_not_break_the_chain() -> None:
    idx = ConversationIndex()

    def body(*more: dict[str, Any], marked: int) -> dict[str, Any]:
        msgs = [{"role": "user", "content": [{"type": "text", "text": "fix it"}]}, *more]
        last = msgs[marked]["content"][-1]
        msgs[marked] = {**msgs[marked], "content": [
            *msgs[marked]["content"][:-1], {**last, "cache_control": {"type": "ephemeral"}}]}
        return {"model": "m", "max_tokens": 9, "system": "sys", "messages": msgs}

    first = step(idx, MSG, body(marked=0))
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                             "input": {"command": "ls"}}]}
    res = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                        "content": "a.txt"}]}
    assert step(idx, MSG, body(use, res, marked=2)) == first


def test_responses_items_chain() -> None:
    idx = ConversationIndex()
    user = {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                            "text": "go"}]}
    first = step(idx, RESP, {"model": "m", "instructions": "i", "input": [user]})
    more = [{"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "f1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "f1", "output": "ok"}]
    assert step(idx, RESP, {"model": "m", "instructions": "i", "input": [user, *more]}
                       ) == first
    assert step(idx, API_BY_PATH["/v1/completions"], {"model": "m", "prompt": "x"}) is None


def test_idle_and_excess_programs_are_forgotten() -> None:
    clock = Clock()
    idx = ConversationIndex(idle_s=10, max_programs=3, clock=clock)
    a = step(idx, CHAT_SPEC, chat(USER))
    clock.t = 11
    # a forgotten conversation that comes back starts a new program (its start's id)
    assert step(idx, CHAT_SPEC, chat(USER, answer("c1"), result("c1"))) == a
    assert len(idx) == 1
    for i in range(5):
        step(idx, CHAT_SPEC, chat({"role": "user", "content": f"task {i}"}))
    assert len(idx) == 3  # the least recently seen went first


def test_conversation_is_the_last_recogniser() -> None:
    assert DEFAULT_ORDER[-1] == "conversation"
    idx = ConversationIndex()
    named = recognise(DEFAULT_ORDER, CHAT_SPEC, Seen({}, {**chat(USER), "program_id": "p"},
                                                     "p", CHAT_SPEC, idx))
    assert named.program_id == "p" and len(idx) == 0
    conv = recognise(DEFAULT_ORDER, CHAT_SPEC, Seen({}, chat(USER), None, CHAT_SPEC, idx))
    assert conv.recogniser == "conversation" and conv.agent == "client"
    assert conv.session is None and conv.program_id is not None


# -- Claude Code's marks --------------------------------------------------------------------
def test_metadata_without_claude_codes_headers_is_no_claude_code() -> None:
    meta = {"user_id": json.dumps({"session_id": "s1"})}
    body = {"model": "m", "max_tokens": 9, "metadata": meta,
            "messages": [{"role": "user", "content": "hi"}]}
    sdk = recognise(DEFAULT_ORDER, MSG, Seen({b"user-agent": "Anthropic/Python 2.17.0"},
                                             body, None))
    assert (sdk.recogniser, sdk.agent, sdk.session) == ("metadata-user", "client", "s1")
    for marks in ({b"x-app": "cli"}, {b"user-agent": "claude-cli/2.1.332 (external, cli)"},
                  {b"anthropic-beta": "claude-code-20250219,effort-2025-11-24"}):
        cc = recognise(DEFAULT_ORDER, MSG, Seen(marks, body, None))
        assert (cc.recogniser, cc.agent, cc.session) == ("claude-code", "claude-code", "s1")


# -- through mori serve ---------------------------------------------------------------------
def start(lt: LoopThread, tmp: Path, **settings: Any) -> tuple[str, Callable[[], None], str]:
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    s = GatewaySettings(**settings)
    cfg = ServeConfig(settings=s, replicas=1, preset="h200-qwen3-30b-a3b",  # type: ignore[arg-type]
                      cpu_ratio=0.5, gpu_kv_tokens=200_000, engine_script=script)
    adapters, handles = lt.call(start_simulated_backends(cfg))
    lt.handles.extend(handles)
    app = create_app(s, adapters)
    url = lt.serve(app).url
    gw = app.state.gateway
    keys = s.admin_keys or s.api_keys
    auth = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    model = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
    return url, lambda: lt.call(gw.shutdown()), model


def programs(url: str, key: str | None = None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    rows: list[dict[str, Any]] = httpx.get(url + "/v1/programs", headers=headers).json()["data"]
    return rows


def run_chat(c: openai.OpenAI, model: str, task: str, tool_s: float) -> None:
    """A mini-swe-agent-like loop: the model calls ``bash``, the tool runs, the result goes
    back with the whole conversation, until the model answers in text."""
    msgs: list[Any] = [{"role": "system", "content": "You are a software agent."},
                       {"role": "user", "content": task}]
    for _ in range(4):
        r = c.chat.completions.create(model=model, messages=msgs, tools=[BASH_FN],
                                      max_tokens=200)
        m = r.choices[0].message
        msgs.append(m.model_dump(exclude_none=True))
        if not m.tool_calls:
            return
        time.sleep(tool_s)
        msgs += [{"role": "tool", "tool_call_id": t.id, "content": "a.txt"}
                 for t in m.tool_calls]
    raise AssertionError("the scripted engine never ended the turn")


def test_sdk_conversations_are_programs_with_tool_time(loop_thread: LoopThread,
                                                       tmp_path: Path) -> None:
    record = tmp_path / "live.jsonl.gz"
    url, stop, model = start(loop_thread, tmp_path, record=str(record))
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    run_chat(c, model, "warm up", 0.0)  # the SDK builds its types on first use
    run_chat(c, model, "list the files", 0.5)
    rows = programs(url)
    assert len(rows) == 2 and {r["recogniser"] for r in rows} == {"conversation"}
    (row,) = [r for r in rows if r["last_tool_s"] and r["last_tool_s"] >= 0.5]
    assert row["agent"] == "client" and row["session"] is None and not row["anonymous"]
    assert row["steps"] == 2 and row["tool_steps"] == 1 and row["tools"] == {"bash": 1}
    assert 0.5 <= row["tool_s"] < 1.5
    # the anthropic SDK: a conversation with tool use, no session named
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    first = a.messages.create(model=model, max_tokens=200, system="You are an agent.",
                              tools=[BASH_TOOL], messages=msgs)
    call = next(b for b in first.content if b.type == "tool_use")
    time.sleep(0.3)
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "a.txt"}]}]
    a.messages.create(model=model, max_tokens=200, system="You are an agent.",
                      tools=[BASH_TOOL], messages=msgs)
    rows = programs(url)
    assert len(rows) == 3
    (mine,) = [r for r in rows if r["tools"] == {"Bash": 1}]
    assert mine["steps"] == 2 and mine["tool_steps"] == 1 and mine["last_tool_s"] >= 0.3
    stop()
    ts = read_traceset(record)
    recorded = {p.name: p for p in ts.programs}
    prog = recorded[row["program_id"]]
    assert [s.gap_kind for s in prog.steps] == [GapKind.TOOL, GapKind.END]
    assert prog.steps[0].tool_names == ("bash",) and 0.5 <= prog.steps[0].gap_s < 1.5
    assert mine["program_id"] in recorded


def test_keys_with_identical_conversations_never_share(loop_thread: LoopThread,
                                                       tmp_path: Path) -> None:
    url, _, model = start(loop_thread, tmp_path, api_keys=("ka", "kb"), admin_keys=("adm",))
    for key in ("ka", "kb"):
        run_chat(openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0), model,
                 "list the files", 0.0)
    mine_a, mine_b = programs(url, "ka"), programs(url, "kb")
    assert len(mine_a) == len(mine_b) == 1
    assert mine_a[0]["steps"] == mine_b[0]["steps"] == 2  # each its own two steps
    assert len(programs(url, "adm")) == 2


@pytest.mark.parametrize("order", ["program-id,conversation", "program-id"])
def test_the_recogniser_can_be_left_out(loop_thread: LoopThread, tmp_path: Path,
                                        order: str) -> None:
    url, _, model = start(loop_thread, tmp_path, program_id_from=order)
    run_chat(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), model,
             "list the files", 0.0)
    assert len(programs(url)) == (1 if "conversation" in order else 0)


def test_anthropic_sdk_metadata_is_no_claude_code(loop_thread: LoopThread,
                                                  tmp_path: Path) -> None:
    record = tmp_path / "live.jsonl.gz"
    url, stop, model = start(loop_thread, tmp_path, record=str(record))
    a = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    a.messages.create(model=model, max_tokens=200, system="s", tools=[BASH_TOOL],
                      metadata={"user_id": json.dumps({"session_id": "run-1"})},
                      messages=[{"role": "user", "content": "go"}])
    (row,) = programs(url)
    assert (row["recogniser"], row["agent"]) == ("metadata-user", "client")
    stop()
    (prog,) = read_traceset(record).programs
    assert prog.provider != "claude"


def test_odd_item_types_read_as_no_answer() -> None:
    """A Responses item's ``type`` may be any JSON value: an unhashable one is no answer's
    type (it never raises), and the conversation is still named."""
    from mori.protocol.apis import conversation_items

    body = {"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": ["function_call"], "call_id": "c"},
        {"type": {"x": 1}, "role": "assistant", "content": "odd"}]}
    conv = conversation_items(RESP, body)
    assert conv is not None and [a for a, _ in conv[1]] == [False, False, False]
    assert ConversationIndex().program(RESP, body) is not None
