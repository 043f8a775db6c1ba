"""The agents' APIs end to end through the gateway, with the official SDKs as clients and
a scripted simulated engine: Anthropic's Messages (streamed and not) and token counting,
OpenAI's Responses; programs recognised from the agents' own session marks and split by
conversation; tool time measured on the wire; model aliases; each API's error shape;
key namespaces; the recorded trace. Each test runs twice: its connections served by the
policy process, and every one by a worker process (``--workers 2``)."""

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
from gateway_harness import BASH, SHELL, LoopThread
from through_workers import WorkersGateway, workers_config

from mori.core.returns import ReturnConfig
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.identity import CONVERSATION, DEFAULT_ORDER
from mori.gateway.server import ServeConfig, start_simulated_backends
from mori.traces.jsonl import read_traceset
from mori.traces.model import GapKind

SCRIPT = {"steps": [
    {"text": "Listing.", "tool": {"Bash": {"command": "ls", "description": "List"},
                                  "shell": {"command": ["bash", "-lc", "ls"]}}},
    {"text": "Done."}]}
SID = "5b9c1f8e-0000-4000-8000-00000000c1a0"
TASK = {"name": "Task", "description": "Start a subagent",
        "input_schema": {"type": "object", "properties": {"prompt": {"type": "string"}}}}


def start(lt: LoopThread, tmp: Path, via: str,
          **settings: Any) -> tuple[str, Callable[[], None], str]:
    """The gateway in front of one scripted simulated engine: its URL, how to stop it
    (every program ended, the record written) and the served model."""
    script = tmp / "script.json"
    script.write_text(json.dumps(SCRIPT))
    # named agents only: the SDKs' warm-up requests stay anonymous (the conversation
    # recogniser: tests/gateway/test_conversation_identity.py)
    settings.setdefault("program_id_from", tuple(
        n for n in DEFAULT_ORDER if n != CONVERSATION))
    s = GatewaySettings(**settings)
    engines = {"replicas": 1, "preset": "h200-qwen3-30b-a3b", "cpu_ratio": 0.5,
               "gpu_kv_tokens": 200_000, "engine_script": script}
    stop: Callable[[], None]
    if via == "workers":
        served = WorkersGateway(lt, workers_config(settings=s, **engines))
        url, stop = served.url, served.close
    else:
        cfg = ServeConfig(settings=s, **engines)  # type: ignore[arg-type]
        adapters, handles = lt.call(start_simulated_backends(cfg))
        lt.handles.extend(handles)
        app = create_app(s, adapters)
        url = lt.serve(app).url
        gw = app.state.gateway
        stop = lambda: lt.call(gw.shutdown())  # noqa: E731
    keys = s.admin_keys or s.api_keys
    auth = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    model = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"]
    return url, stop, model


CLAUDE_CLI = {"x-app": "cli", "User-Agent": "claude-cli/2.1.332 (external, sdk-cli)"}
"""Claude Code's own headers: with them, ``metadata.user_id`` names a Claude Code session."""


def claude_metadata(session: str = SID) -> dict[str, str]:
    return {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "",
                                   "session_id": session})}


def programs(url: str, key: str | None = None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    rows: list[dict[str, Any]] = httpx.get(url + "/v1/programs", headers=headers).json()["data"]
    return rows


def test_claude_code_like_session_through_messages(loop_thread: LoopThread, via: str,
                                                   tmp_path: Path) -> None:
    record = tmp_path / "live.jsonl.gz"
    url, stop, model = start(loop_thread, tmp_path, via, record=str(record))
    c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0,
                        default_headers=CLAUDE_CLI)
    system = [{"type": "text", "text": "You are Claude Code."}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    with c.messages.stream(model=model, max_tokens=10, messages=msgs) as s:
        s.get_final_message()  # warm the SDK's types up (an anonymous request)
    with c.messages.stream(model=model, max_tokens=4096, system=system, messages=msgs,
                           tools=[BASH, TASK], metadata=claude_metadata()) as s:
        first = s.get_final_message()
    assert first.stop_reason == "tool_use"
    call = next(b for b in first.content if b.type == "tool_use")
    assert call.name == "Bash" and call.input == {"command": "ls", "description": "List"}
    (row,) = programs(url)
    assert (row["agent"], row["recogniser"], row["session"]) == ("claude-code", "claude-code",
                                                                  SID)
    assert row["in_tool"] == ["Bash"] and row["tools"] == {"Bash": 1}
    # its length predicted: nothing known yet of Bash or of Claude Code, so the prior
    assert row["expected_tool_s"] == ReturnConfig().prior_s
    time.sleep(0.4)  # the tool runs
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "a.txt\nb.txt"}]}]
    second = c.messages.create(model=model, max_tokens=4096, system=system, messages=msgs,
                               tools=[BASH, TASK], metadata=claude_metadata())
    assert second.stop_reason == "end_turn" and second.content[0].type == "text"
    assert second.usage.cache_read_input_tokens and second.usage.cache_read_input_tokens > 0
    (row,) = programs(url)
    assert row["program_id"] == programs(url)[0]["program_id"]  # one program, two steps
    assert row["steps"] == 2 and row["tool_steps"] == 1 and row["in_tool"] == []
    assert 0.4 <= row["last_tool_s"] < 1.5
    assert row["expected_tool_s"] is None  # no call pending
    assert row["last_tool_error_s"] == pytest.approx(ReturnConfig().prior_s - row["last_tool_s"],
                                                     abs=1e-5)
    metrics = httpx.get(url + "/metrics").text
    assert 'mori_tool_call_seconds_count{agent="claude-code"} 1.0' in metrics
    assert ('mori_tool_call_prediction_error_seconds_count{agent="claude-code"} 1.0'
            in metrics)
    # count_tokens: answered, not held, no program made
    n = c.messages.count_tokens(model=model, messages=msgs, system=system)
    assert n.input_tokens > 0 and len(programs(url)) == 1
    # the dashboard lists the program with its agent kind and tools
    frame = httpx.get(url + "/dashboard/state").json()["frame"]
    (p,) = frame["programs"]
    assert p[8] == "claude-code" and "Bash" in p[9]
    assert httpx.post(url + f"/v1/programs/{row['program_id']}/release").status_code == 200
    stop()
    ts = read_traceset(record)
    (prog,) = ts.programs
    assert [s.gap_kind for s in prog.steps] == [GapKind.TOOL, GapKind.END]
    assert prog.steps[0].tool_names == ("Bash",)
    assert 0.4 <= prog.steps[0].gap_s < 1.5
    assert prog.steps[1].reuse_tokens > 0


def test_subagent_is_its_own_program_with_its_parent(loop_thread: LoopThread, via: str,
                                                     tmp_path: Path) -> None:
    url, _, model = start(loop_thread, tmp_path, via)
    c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0,
                        default_headers=CLAUDE_CLI)
    main = c.messages.create(model=model, max_tokens=100, tools=[BASH, TASK],
                             system="You are Claude Code.", metadata=claude_metadata(),
                             messages=[{"role": "user", "content": "explore"}])
    assert main.stop_reason == "tool_use"
    # while the main conversation is in its tool call, a subagent of the same session
    c.messages.create(model=model, max_tokens=100, tools=[BASH],
                      system="You are a file search specialist.",
                      metadata=claude_metadata(),
                      messages=[{"role": "user", "content": "find config files"}])
    rows = {r["program_id"]: r for r in programs(url)}
    assert len(rows) == 2 and {r["session"] for r in rows.values()} == {SID}
    (sub,) = [r for r in rows.values() if r["parent"] is not None]
    assert rows[sub["parent"]]["parent"] is None


def test_codex_like_session_through_responses(loop_thread: LoopThread, via: str,
                                              tmp_path: Path) -> None:
    url, _, model = start(loop_thread, tmp_path, via,
                          model_aliases=("gpt-*=" + "__served__",))
    # the alias rule's target is not served: a clear 404, not an engine error
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="gpt-5-codex", input="hi")
    # the SDK builds its response types on first use (about a second here): warm it up
    # (an anonymous request) so that the tool time measured below is the sleep's
    list(c.responses.create(model=model, input="warm up", tools=[SHELL], stream=True))
    headers = {"session-id": "codex-s1", "x-codex-window-id": "codex-s1:0"}
    inp: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                  "content": [{"type": "input_text", "text": "list files"}]}]
    events = list(c.responses.create(model=model, input=inp, tools=[SHELL], stream=True,
                                     instructions="You are Codex.", extra_headers=headers,
                                     prompt_cache_key="codex-s1"))
    done = events[-1]
    assert done.type == "response.completed"
    (fc,) = [o for o in done.response.output if o.type == "function_call"]
    assert fc.name == "shell"
    time.sleep(0.3)
    inp += [{"type": "function_call", "call_id": fc.call_id, "name": fc.name,
             "arguments": fc.arguments},
            {"type": "function_call_output", "call_id": fc.call_id, "output": "a.txt"}]
    r = c.responses.create(model=model, input=inp, tools=[SHELL], instructions="You are Codex.",
                           extra_headers=headers, prompt_cache_key="codex-s1")
    assert r.output_text and r.usage is not None and r.usage.input_tokens > 0
    (row,) = programs(url)
    assert row["program_id"] == "codex:codex-s1/codex-s1:0"
    assert (row["agent"], row["recogniser"], row["tool_steps"]) == ("codex", "codex", 1)
    assert 0.3 <= row["last_tool_s"] < 1.5 and row["tools"] == {"shell": 1}


def test_aliases_and_error_shapes(loop_thread: LoopThread, via: str, tmp_path: Path) -> None:
    url, _, model = start(loop_thread, tmp_path, via, model_aliases=("claude-*=not-served",))
    c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0,
                        default_headers=CLAUDE_CLI)
    for asked in ("unknown-model", "claude-opus-4"):  # unmapped; mapped to no served model
        with pytest.raises(anthropic.NotFoundError) as e:
            c.messages.create(model=asked, max_tokens=10,
                              messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
        assert model in e.value.body["error"]["message"]  # type: ignore[index]
    bad = httpx.post(url + "/v1/messages?beta=true", json={"model": model, "messages": []})
    assert bad.status_code == 400
    assert bad.json()["type"] == "error"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.json()["error"]["message"] or \
        "messages" in bad.json()["error"]["message"]
    for raw in (b"{", b"[]", b'{"model": 1}', b'{"model": "m", "max_tokens": 1, '
                b'"messages": [{"role": "user", "content": 5}]}'):
        r = httpx.post(url + "/v1/messages", content=raw)
        assert r.status_code == 400 and r.json()["type"] == "error", raw
        r = httpx.post(url + "/v1/responses", content=raw)  # the last: model "m" unknown
        assert r.status_code in (400, 404) and "type" not in r.json(), raw
        assert r.json()["error"]["type"] == "invalid_request_error", raw
    r = httpx.get(url + "/v1/messages")
    assert r.status_code == 405


def test_alias_maps_agent_models(loop_thread: LoopThread, via: str, tmp_path: Path) -> None:
    lt = loop_thread
    url, _, model = start(lt, tmp_path, "policy")
    lt2 = LoopThread()
    try:
        url2, _, _ = start(lt2, tmp_path, via, model_aliases=(f"claude-*={model}",))
        c = anthropic.Anthropic(base_url=url2, api_key="none", max_retries=0,
                        default_headers=CLAUDE_CLI)
        m = c.messages.create(model="claude-sonnet-4-5-20250929", max_tokens=10,
                              messages=[{"role": "user", "content": "hi"}])
        assert m.model == model and m.content[0].type == "text"
    finally:
        lt2.close()
    assert url != url2


def test_session_ids_stay_in_their_key_namespace(loop_thread: LoopThread, via: str,
                                                 tmp_path: Path) -> None:
    url, _, model = start(loop_thread, tmp_path, via, api_keys=("ka", "kb"),
                          admin_keys=("adm",))
    for key in ("ka", "kb"):
        # Claude Code sends its key as x-api-key
        c = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0,
                        default_headers=CLAUDE_CLI)
        c.messages.create(model=model, max_tokens=5, metadata=claude_metadata(),
                          system="s", messages=[{"role": "user", "content": "same"}],
                          tools=[BASH])  # an agent step (a tool-less one is a side request)
    mine_a, mine_b = programs(url, "ka"), programs(url, "kb")
    assert len(mine_a) == len(mine_b) == 1
    assert mine_a[0]["program_id"] == mine_b[0]["program_id"]  # as each key names it
    assert mine_a[0]["session"] == SID
    assert len(programs(url, "adm")) == 2  # two programs inside the gateway
    no_key = httpx.post(url + "/v1/messages", json={"model": model, "max_tokens": 1,
                                                     "messages": [{"role": "user",
                                                                   "content": "x"}]})
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == \
        "authentication_error"


def test_a_named_parent_wins_over_the_inferred_one(loop_thread: LoopThread, via: str,
                                                   tmp_path: Path) -> None:
    """A Codex child thread names its parent thread: it is recorded as that program's
    subagent even when another program of the session is the one in a tool call."""
    url, _, model = start(loop_thread, tmp_path, via)
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

    def call(thread: str, window: str, parent: str | None = None) -> None:
        h = {"session-id": "s", "thread-id": thread, "x-codex-window-id": window}
        if parent:
            h["x-codex-parent-thread-id"] = parent
        c.responses.create(model=model, input=f"work of {thread}", tools=[SHELL],
                           extra_headers=h)

    call("t1", "t1:1")   # the parent, in its second window; ends in a tool call
    call("t9", "t9:0")   # another thread of the session, in a tool call later
    call("t2", "t2:0", parent="t1")
    rows = {r["program_id"]: r for r in programs(url)}
    assert rows["codex:s/t2:0"]["parent"] == "codex:s/t1:1"
    assert rows["codex:s/t9:0"]["parent"] == "codex:s/t1:1"  # inferred: t1 in a tool call


def test_programs_per_key_are_capped_in_the_apis_shape(loop_thread: LoopThread, via: str,
                                                      tmp_path: Path) -> None:
    """``--max-programs-per-key``: a key's third program is refused with 429 (and
    Retry-After) in the shape of the API it came in on; another key is not counted."""
    url, _, model = start(loop_thread, tmp_path, via, api_keys=("ka", "kb"),
                          max_programs_per_key=2)
    c = anthropic.Anthropic(base_url=url, api_key="ka", max_retries=0)
    for session in ("s1", "s2"):
        c.messages.create(model=model, max_tokens=5, metadata=claude_metadata(session),
                          system="s", tools=[BASH],  # a tool: no side request
                          messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.RateLimitError) as e:
        c.messages.create(model=model, max_tokens=5, metadata=claude_metadata("s3"),
                          system="s", tools=[BASH], messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error"  # type: ignore[index]
    assert "--max-programs-per-key" in e.value.body["error"]["message"]  # type: ignore[index]
    assert e.value.response.headers.get("retry-after")
    o = openai.OpenAI(base_url=url + "/v1", api_key="ka", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e2:
        o.responses.create(model=model, input="hi", prompt_cache_key="s4")
    body = e2.value.response.json()  # OpenAI's shape: the error alone, no top-level type
    assert "type" not in body and "--max-programs-per-key" in body["error"]["message"]
    other = anthropic.Anthropic(base_url=url, api_key="kb", max_retries=0)
    other.messages.create(model=model, max_tokens=5, metadata=claude_metadata("s1"),
                          system="s", tools=[BASH], messages=[{"role": "user", "content": "hi"}])
    assert len(programs(url, "ka")) == 2 and len(programs(url, "kb")) == 1
