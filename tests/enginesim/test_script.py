"""Scripted answers (``mori.sim.script``, ``mori.enginesim.answers``): the file format and
its errors, the step rule, tool calls on the three APIs through their official clients,
``script_from_trace``, and ``mori engine-sim``'s script options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mori.cli.main import main
from mori.enginesim import EngineSimServer, Script, ScriptError, load_script, parse_script
from mori.enginesim.answers import (
    Api,
    Stop,
    answer_for,
    offered_tools,
    script_step,
    tool_namespaces,
)
from mori.sim.script import script_from_trace
from mori.traces.jsonl import write_traceset
from mori.traces.model import GapKind, ProgramTrace, Step, TraceSet

from .harness import MODEL, PRESET, anthropic_client, client, run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent-script.json"
LS = {"command": "sleep 0 && ls", "description": "List files"}
SCRIPT = parse_script({"steps": [
    {"text": "Looking.", "tool": {"Bash": LS, "shell": {"command": ["bash", "-lc", "ls"]},
                                  "exec_command": {"cmd": "ls"}}},
    {"tool": {"Bash": {"command": "pwd"}, "exec_command": {"cmd": "pwd"}}},
    {"text": "Done."}]})

# -- the format -----------------------------------------------------------------------------

def test_the_example_loads_and_toml_too(tmp_path: Path) -> None:
    example = load_script(EXAMPLE)
    assert [s.text for s in example.steps][-1] == "Done."
    assert [t.name for t in example.steps[0].tools] == ["Bash", "shell", "exec_command",
                                                        "run_shell_command"]
    assert example.steps[0].tools[2].input == {"cmd": "sleep 2 && ls"}
    toml = tmp_path / "s.toml"
    toml.write_text('fallback = "Hm."\n[[steps]]\ntext = "a"\n[steps.tool.Bash]\n'
                    'command = "ls"\n[[steps]]\ntext = "b"\n')
    script = load_script(toml)
    assert script.fallback == "Hm." and script.final_text == "b"
    assert script.steps[0].tool_for(["Read", "Bash"]) == script.steps[0].tools[0]


@pytest.mark.parametrize("content, where", [
    ('{"steps": [', "line 1 column 12: invalid JSON"),
    ("[1]", "a script must be an object"),
    ('{"steps": []}', "steps: must be a non-empty array"),
    ('{"steps": [{"tool": {"Bash": "ls"}}]}', "steps[0].tool.Bash: the tool's input must be"),
    ('{"steps": [{"text": "a"}, {}]}', "steps[1]: a step needs a 'text' or a 'tool'"),
    ('{"steps": [{"txt": "a"}]}', "steps[0]: unknown field 'txt'"),
    ('{"steps": [{"text": "a"}], "fallback": ""}', "fallback: must be a non-empty string"),
    ('{"steps": [{"text": "a", "requires": "Bash"}]}',
     "steps[0].requires: must be an array of tool names, or an object"),
    ('{"steps": [{"tool": {"Bash": {}}, "requires": {"Agent": ["X"]}}]}',
     "steps[0].requires.Agent: names no tool of the step's 'tool'"),
    ('{"steps": [{"tool": {"Bash": {}}, "requires": {"Bash": "X"}}]}',
     "steps[0].requires.Bash: must be an array of tool names"),
])
def test_bad_scripts_name_the_file_and_the_field(tmp_path: Path, content: str,
                                                  where: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ScriptError) as e:
        load_script(f)
    assert str(e.value).startswith(f"{f}: ") and where in str(e.value)


# -- the step rule --------------------------------------------------------------------------

def tool_result(n: int = 1, text: bool = False) -> dict[str, Any]:
    blocks: list[Any] = [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok"}
                         for i in range(n)]
    if text:  # agents add reminders next to tool results: still no new prompt
        blocks.append({"type": "text", "text": "<reminder>"})
    return {"role": "user", "content": blocks}


def test_the_step_is_the_tool_results_since_the_last_prompt() -> None:
    said = {"role": "assistant", "content": "ok"}
    user = {"role": "user", "content": "do it"}
    assert script_step(Api.MESSAGES, {"messages": [user]}) == 0
    assert script_step(Api.MESSAGES, {"messages": [user, said, tool_result()]}) == 1
    assert script_step(Api.MESSAGES, {"messages": [
        user, said, tool_result(), said, tool_result(2, text=True)]}) == 3
    assert script_step(Api.MESSAGES, {"messages": [
        user, said, tool_result(), said, {"role": "user", "content": [
            {"type": "text", "text": "again"}]}]}) == 0  # a new prompt restarts
    out = {"type": "function_call_output", "call_id": "c", "output": "ok"}
    assert script_step(Api.RESPONSES, {"input": [
        {"role": "user", "content": "go"}, out, {"role": "developer", "content": "x"},
        out]}) == 2
    assert script_step(Api.RESPONSES, {"input": [out, {"role": "user", "content": "go"}]}) == 0
    assert script_step(Api.CHAT, {"messages": [
        {"role": "user", "content": "go"}, {"role": "tool", "content": "ok"}]}) == 1


def test_a_notification_of_background_work_is_no_prompt() -> None:
    """Claude Code's background subagent ends with a ``<task-notification>`` user turn,
    Codex's with a ``<subagent_notification>`` one: the script goes on where it was
    (restarting it would start the subagent again, and again)."""
    said = {"role": "assistant", "content": "ok"}
    user = {"role": "user", "content": "do it"}
    note = {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\n<tools-used>Bash</tools-used>"},
        {"type": "text", "text": "<system-reminder>\n[SYSTEM NOTIFICATION]\n"
                                 "<task-notification>\n<status>completed</status>"}]}
    assert script_step(Api.MESSAGES, {"messages": [user, said, tool_result(), said,
                                                   note]}) == 1
    assert script_step(Api.MESSAGES, {"messages": [user, said, note]}) == 0
    out = {"type": "function_call_output", "call_id": "c", "output": "ok"}
    codex_note = {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "<subagent_notification>\n{}\n"
                                       "</subagent_notification>"}]}
    assert script_step(Api.RESPONSES, {"input": [
        {"role": "user", "content": "go"}, out, out, codex_note]}) == 2
    assert script_step(Api.CHAT, {"messages": [
        {"role": "user", "content": "go"}, {"role": "tool", "content": "ok"},
        {"role": "user", "content": "<task-notification>done</task-notification>"}]}) == 1


def test_a_tool_may_require_others_and_name_a_result_field() -> None:
    script = parse_script({"steps": [
        {"text": "Asking.", "requires": {"Agent": ["ScheduleWakeup"]},
         "tool": {"Agent": {"prompt": "p"}, "Bash": {"command": "sleep 2"}}},
        {"tool": {"wait_agent": {"targets": ["{{result.agent_id}}"], "note": "{{result.x}}",
                                 "n": 1}}},
        {"text": "Done."}]})
    main = {"tools": [{"name": "Agent"}, {"name": "Bash"}, {"name": "ScheduleWakeup"}],
            "messages": [{"role": "user", "content": "x"}]}
    sub = {**main, "tools": [{"name": "Agent"}, {"name": "Bash"}]}
    first = answer_for(Api.MESSAGES, main, script, None).tool
    assert first is not None and first.name == "Agent"
    first = answer_for(Api.MESSAGES, sub, script, None).tool
    assert first is not None and first.name == "Bash"  # a subagent: the next one it offers
    # the spawned agent's id, read from the last tool result (a JSON object)
    tools = [{"type": "namespace", "name": "multi_agent_v1",
              "tools": [{"type": "function", "name": "wait_agent", "parameters": {}}]}]
    body = {"tools": tools, "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call_output", "call_id": "c",
         "output": json.dumps({"agent_id": "a-1", "nickname": "N"})}]}
    wait = answer_for(Api.RESPONSES, body, script, None).tool
    assert wait is not None and wait.namespace == "multi_agent_v1"
    assert wait.input == {"targets": ["a-1"], "note": "{{result.x}}", "n": 1}
    body["input"][-1]["output"] = "not JSON"
    wait = answer_for(Api.RESPONSES, body, script, None).tool
    assert wait is not None and wait.input["targets"] == ["{{result.agent_id}}"]


def test_tools_of_a_namespace_are_offered_bare_and_qualified() -> None:
    spawn = {"type": "function", "name": "spawn_agent", "parameters": {}}
    tools: list[Any] = [{"type": "function", "name": "exec_command", "parameters": {}},
                        {"type": "namespace", "name": "multi_agent_v1", "tools": [spawn]},
                        {"type": "web_search"}]
    assert offered_tools(Api.RESPONSES, {"tools": tools}) == [
        "exec_command", "spawn_agent", "multi_agent_v1.spawn_agent"]
    assert tool_namespaces(Api.RESPONSES, {"tools": tools}) == {
        "spawn_agent": "multi_agent_v1", "multi_agent_v1.spawn_agent": "multi_agent_v1"}
    # a bare name also offered outside the namespace is that tool's
    both = [spawn, *tools]
    assert tool_namespaces(Api.RESPONSES, {"tools": both}) == {
        "multi_agent_v1.spawn_agent": "multi_agent_v1"}
    assert tool_namespaces(Api.MESSAGES, {"tools": tools}) == {}
    for name in ("spawn_agent", "multi_agent_v1.spawn_agent"):
        script = parse_script({"steps": [{"tool": {name: {"message": "m"}}}]})
        call = answer_for(Api.RESPONSES, {"tools": tools, "input": [
            {"role": "user", "content": "go"}]}, script, None).tool
        assert call is not None
        assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    plain = parse_script({"steps": [{"tool": {"spawn_agent": {"message": "m"}}}]})
    call = answer_for(Api.RESPONSES, {"tools": both, "input": [
        {"role": "user", "content": "go"}]}, plain, None).tool
    assert call is not None and (call.name, call.namespace) == ("spawn_agent", None)


def test_answers_follow_the_script() -> None:
    bash = {"tools": [{"name": "Bash"}, {"name": "Read"}]}
    read = {"tools": [{"name": "Read"}]}
    first = answer_for(Api.MESSAGES, {**bash, "messages": [{"role": "user", "content": "x"}]},
                       SCRIPT, 32000)
    assert first.stop is Stop.TOOL and first.text == "Looking."
    assert first.tool is not None and first.tool.input == LS
    assert first.tokens == 2 + 1 + -(-len(json.dumps(LS, separators=(",", ":"))) // 4)
    # a request offering none of the step's tools: the step's text; no text: the fallback
    assert answer_for(Api.MESSAGES, {**read, "messages": [{"role": "user", "content": "x"}]},
                      SCRIPT, None).tool is None
    second = answer_for(Api.MESSAGES, {**read, "messages": [tool_result()]}, SCRIPT, None)
    assert (second.text, second.stop) == ("OK.", Stop.END)
    # past the last step: the final text; no tools at all: the fallback
    late = answer_for(Api.MESSAGES, {**bash, "messages": [tool_result(5)]}, SCRIPT, None)
    assert (late.text, late.stop) == ("Done.", Stop.END)
    side = answer_for(Api.MESSAGES, {"messages": [tool_result()]}, SCRIPT, None)
    assert side.text == "OK."
    # capped: the text up to the cap, the call dropped
    cut = answer_for(Api.MESSAGES, {**bash, "messages": [{"role": "user", "content": "x"}]},
                     SCRIPT, 4)
    assert (cut.tokens, cut.tool, cut.stop, cut.text) == (4, None, Stop.LENGTH, "Looking.")


# -- tool calls over HTTP -------------------------------------------------------------------

def test_scripted_tool_calls_on_messages() -> None:
    tools: list[Any] = [{"name": "Bash", "description": "run",
                         "input_schema": {"type": "object"}}]

    async def go(srv: EngineSimServer) -> None:
        async with anthropic_client(srv) as c:
            msgs: list[Any] = [{"role": "user", "content": "list the files"}]
            m = await c.messages.create(model=MODEL, max_tokens=8192, messages=msgs,
                                        tools=tools)
            assert m.stop_reason == "tool_use"
            assert [b.type for b in m.content] == ["text", "tool_use"]
            use = m.content[1]
            assert use.type == "tool_use" and use.id.startswith("toolu_")
            assert (use.name, use.input) == ("Bash", LS)
            assert m.usage.output_tokens == SCRIPT_ANSWER_TOKENS
            async with c.messages.stream(model=MODEL, max_tokens=32000, messages=msgs,
                                         tools=tools) as s:
                streamed = await s.get_final_message()
            assert streamed.stop_reason == "tool_use"
            assert [b.type for b in streamed.content] == ["text", "tool_use"]
            assert streamed.content[1].type == "tool_use"
            assert streamed.content[1].input == LS
            msgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": use.id, "content": "a b"}]}]
            m = await c.messages.create(model=MODEL, max_tokens=8192, messages=msgs,
                                        tools=tools)
            assert m.content[0].type == "tool_use" and m.content[0].input == {
                "command": "pwd"}
            msgs += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result",
                                                   "tool_use_id": m.content[0].id}]}]
            async with c.messages.stream(model=MODEL, max_tokens=32000, messages=msgs,
                                         tools=tools) as s:
                last = await s.get_final_message()
            assert last.stop_reason == "end_turn"
            assert last.content[0].type == "text" and last.content[0].text == "Done."

    run(go, script=SCRIPT)


SCRIPT_ANSWER_TOKENS = 2 + 1 + -(-len(json.dumps(LS, separators=(",", ":"))) // 4)


def test_scripted_tool_calls_on_responses() -> None:
    tools: list[Any] = [{"type": "function", "name": "shell", "parameters": {}},
                        {"type": "function", "name": "exec_command", "parameters": {}}]

    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            items: list[Any] = [{"role": "user", "content": "list the files"}]
            r = await c.responses.create(model=MODEL, input=items, tools=tools)
            assert [o.type for o in r.output] == ["message", "function_call"]
            call = r.output[1]
            assert call.type == "function_call" and call.call_id.startswith("call_")
            assert call.status == "completed" and call.name == "shell"
            assert json.loads(call.arguments) == {"command": ["bash", "-lc", "ls"]}
            stream = await c.responses.create(model=MODEL, input=items, tools=tools,
                                              stream=True)
            kinds, args, final = [], "", None
            async for ev in stream:
                kinds.append(ev.type)
                if ev.type == "response.function_call_arguments.delta":
                    args += ev.delta
                elif ev.type == "response.completed":
                    final = ev.response
            assert json.loads(args) == {"command": ["bash", "-lc", "ls"]}
            assert "response.function_call_arguments.done" in kinds
            assert kinds.count("response.output_item.done") == 2
            assert final is not None and final.output[1].type == "function_call"
            items += [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                       "arguments": call.arguments},
                      {"type": "function_call_output", "call_id": call.call_id,
                       "output": "a b"}]
            async with c.responses.stream(model=MODEL, input=items, tools=tools) as s:
                second = await s.get_final_response()
            assert [o.type for o in second.output] == ["function_call"]
            assert second.output[0].type == "function_call"
            assert second.output[0].name == "exec_command"
            assert json.loads(second.output[0].arguments) == {"cmd": "pwd"}
            items += [{"type": "function_call_output", "call_id": "x", "output": "/"}]
            r = await c.responses.create(model=MODEL, input=items, tools=tools)
            assert r.output_text == "Done." and r.status == "completed"

    run(go, script=SCRIPT)


def test_a_namespaced_call_carries_its_namespace_on_responses() -> None:
    tools: list[Any] = [{"type": "namespace", "name": "multi_agent_v1", "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {}}]}]
    script = parse_script({"steps": [{"tool": {"spawn_agent": {"message": "m"}}},
                                     {"text": "Done."}]})

    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            items: list[Any] = [{"role": "user", "content": "go"}]
            r = await c.responses.create(model=MODEL, input=items, tools=tools)
            (call,) = [o.model_dump() for o in r.output if o.type == "function_call"]
            assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")
            async with c.responses.stream(model=MODEL, input=items, tools=tools) as s:
                final = await s.get_final_response()
            done = [o.model_dump() for o in final.output if o.type == "function_call"]
            assert done[0]["namespace"] == "multi_agent_v1"

    run(go, script=script)


def test_scripted_tool_calls_on_chat() -> None:
    tools: list[Any] = [{"type": "function", "function": {"name": "exec_command",
                                                          "parameters": {}}}]

    async def go(srv: EngineSimServer) -> None:
        async with client(srv) as c:
            msgs: list[Any] = [{"role": "user", "content": "list the files"}]
            r = await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools)
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Looking."
            calls = choice.message.tool_calls or []
            assert len(calls) == 1 and calls[0].id.startswith("call_")
            assert calls[0].type == "function"
            assert calls[0].function.name == "exec_command"
            assert json.loads(calls[0].function.arguments) == {"cmd": "ls"}
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools,
                                                     stream=True)
            text, args, names, finish = "", "", [], None
            async for ch in stream:
                delta = ch.choices[0].delta
                text += delta.content or ""
                for tc in delta.tool_calls or []:
                    names += [tc.function.name] if tc.function and tc.function.name else []
                    args += (tc.function.arguments or "") if tc.function else ""
                finish = ch.choices[0].finish_reason or finish
            assert (text, names, finish) == ("Looking.", ["exec_command"], "tool_calls")
            assert json.loads(args) == {"cmd": "ls"}
            msgs += [{"role": "assistant", "content": "Looking.",
                      "tool_calls": [calls[0].model_dump()]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "a b"},
                     {"role": "tool", "tool_call_id": "other", "content": "/"}]
            r = await c.chat.completions.create(model=MODEL, messages=msgs, tools=tools,
                                                max_tokens=100)
            assert r.choices[0].message.content == "Done."
            assert r.choices[0].finish_reason == "stop"
            assert r.usage is not None and r.usage.completion_tokens == 2
            # no tools offered: the fallback; completions are never scripted
            r = await c.chat.completions.create(model=MODEL, messages=msgs[:1])
            assert r.choices[0].message.content == "OK."
            t = await c.completions.create(model=MODEL, prompt="x", max_tokens=3)
            assert len(t.choices[0].text.split()) == 3

    run(go, script=SCRIPT)


# -- from a trace ---------------------------------------------------------------------------

def program(name: str = "p1") -> ProgramTrace:
    return ProgramTrace(name, (
        Step(100, 10, 2.5, GapKind.TOOL), Step(200, 10, 30.0, GapKind.HUMAN),
        Step(300, 10, 0.25, GapKind.TOOL), Step(400, 10, 0.0, GapKind.END)))


def test_script_from_trace_sleeps_through_the_tool_gaps() -> None:
    script = script_from_trace(program())
    assert len(script.steps) == 3 and script.final_text == "Done."
    first, second = script.steps[0], script.steps[1]
    assert [t.name for t in first.tools] == ["Bash", "shell", "exec_command",
                                             "run_shell_command"]
    assert first.tools[0].input["command"] == "sleep 2.5"
    assert first.tools[1].input == {"command": ["bash", "-lc", "sleep 2.5"]}
    assert second.tools[2].input == {"cmd": "sleep 0.25"}
    assert second.tools[3].input["command"] == "sleep 0.25"
    only = script_from_trace(program(), tool_names=["run"])
    assert [t.input for t in only.steps[1].tools] == [{"command": "sleep 0.25"}]


# -- the command line -----------------------------------------------------------------------

def engine_sim(*flags: str) -> list[str]:
    return ["engine-sim", "--preset", PRESET, "--port", "0", *flags]


def test_script_options_that_cannot_be_used_exit_2(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"steps": [{"tool": []}]}')
    trace = tmp_path / "t.jsonl"
    write_traceset(TraceSet("t", (program("p1"), program("p2"))), trace)
    for flags, expected in [
        (["--script", str(tmp_path / "missing.json")], "missing.json: cannot read it"),
        (["--script", str(bad)], f"{bad}: steps[0].tool: must be a non-empty object"),
        (["--script-from-trace", str(tmp_path / "no.jsonl")], "no.jsonl"),
        (["--script-from-trace", str(trace), "--program", "p9"],
         "no program named 'p9' (programs: p1, p2)"),
        (["--program", "p1"], "--program needs --script-from-trace"),
    ]:
        assert main(engine_sim(*flags)) == 2
        err = capsys.readouterr().err
        assert err.startswith("mori engine-sim: error: ") and expected in err, err
        assert "Traceback" not in err
    assert main(engine_sim("--script", str(bad), "--script-from-trace", str(trace))) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_script_options_make_the_script() -> None:
    from mori.cli.engine_sim_cmd import script_of
    from mori.cli.main import build_parser

    def script(*flags: str) -> Script | None:
        return script_of(build_parser().parse_args(engine_sim(*flags)))

    assert script() is None
    assert script("--script", str(EXAMPLE)) == load_script(EXAMPLE)
    made = script("--script-from-trace", "kv-cache-tester-31")  # a shipped set
    assert made is not None and len(made.steps) >= 2
