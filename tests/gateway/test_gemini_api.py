"""The Gemini API through the gateway (``mori.protocol.gemini``), with Google's official
``google-genai`` SDK as the client: ``generateContent`` and
``streamGenerateContent?alt=sse`` against a scripted simulated engine (a function call,
its response, the answer after it), ``countTokens``; the conversation recogniser's one
program with the tool's time measured on the wire; served by the policy process and by a
worker. Then the errors, each in the Gemini API's shape: bad bodies, an unknown model or
method, no key, a wrong method, and the engine's failures (an error status, an error
event, a stream cut off) from a fake engine, which also shows what the engine was asked.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import FakeEngine, LoopThread, Running
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from scripted_gateway import programs, start_scripted

from mori.engines.http import OpenAIHTTPAdapter
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.conversations import ConversationIndex
from mori.protocol.apis import GEMINI_APIS
from mori.protocol.gemini.routes import STREAM as STREAM_METHOD

SCRIPT = {"steps": [
    {"text": "Listing.", "tool": {"run_shell_command": {"command": "ls"}}},
    {"text": "Done: one file."}]}
SHELL = types.FunctionDeclaration(
    name="run_shell_command", description="Runs a shell command",
    parameters_json_schema={"type": "object", "properties": {"command": {"type": "string"}},
                            "required": ["command"]})
SYSTEM = "You are a careful agent."
PROMPT = types.Content(role="user", parts=[types.Part(text="List the files here.")])
TOOL_S = 0.6


def client(url: str, key: str = "k") -> genai.Client:
    return genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=url, api_version="v1beta", timeout=30_000))


def config(**extra: Any) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(system_instruction=SYSTEM,
                                       tools=[types.Tool(function_declarations=[SHELL])],
                                       max_output_tokens=200, temperature=0.5, **extra)


def response_to(call: types.FunctionCall) -> types.Content:
    return types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
        id=call.id, name=call.name, response={"output": "marker.txt"}))])


def test_a_tool_loop_is_one_program_with_its_tool_time(loop_thread: LoopThread, tmp_path: Path,
                                                       via: str) -> None:
    url, model = start_scripted(loop_thread, tmp_path, via, SCRIPT)
    c = client(url)
    first = c.models.generate_content(model=model, contents=[PROMPT], config=config())
    assert first.text == "Listing."
    (call,) = first.function_calls or []
    assert (call.name, call.args) == ("run_shell_command", {"command": "ls"}) and call.id
    assert first.candidates and first.candidates[0].finish_reason == types.FinishReason.STOP
    usage = first.usage_metadata
    assert usage and usage.prompt_token_count and usage.candidates_token_count
    assert usage.total_token_count == usage.prompt_token_count + usage.candidates_token_count
    time.sleep(TOOL_S)  # the tool runs
    model_turn = first.candidates[0].content
    assert model_turn is not None
    chunks = list(c.models.generate_content_stream(
        model=model, contents=[PROMPT, model_turn, response_to(call)], config=config()))
    assert len(chunks) >= 2  # the text as it comes, then the last chunk
    assert "".join(ch.text or "" for ch in chunks) == "Done: one file."
    last = chunks[-1]
    assert last.candidates and last.candidates[0].finish_reason == types.FinishReason.STOP
    assert last.usage_metadata and last.usage_metadata.prompt_token_count
    assert last.usage_metadata.prompt_token_count > usage.prompt_token_count  # it grew
    assert not any(ch.function_calls for ch in chunks)
    rows = [r for r in programs(url).values() if not r["anonymous"]]
    assert len(rows) == 1, rows  # one conversation, one program
    (row,) = rows
    assert row["recogniser"] == "conversation" and row["agent"] == "client"
    assert row["steps"] == 2 and row["tools"] == {"run_shell_command": 1}
    assert row["tool_steps"] == 1 and TOOL_S * 0.9 <= row["tool_s"] <= TOOL_S + 2.0
    # a streamed first call: the function call comes whole, in the last chunk
    chunks = list(c.models.generate_content_stream(model=model, contents=[PROMPT],
                                                   config=config()))
    calls = [fc for ch in chunks for fc in ch.function_calls or []]
    assert [fc.args for fc in calls] == [{"command": "ls"}] and chunks[-1].function_calls
    # countTokens: no model call, the prompt's estimated size
    n = c.models.count_tokens(model=model, contents=[PROMPT]).total_tokens
    assert n is not None and n >= 1


def test_gemini_cli_is_named_by_its_user_agent(loop_thread: LoopThread, tmp_path: Path,
                                              via: str) -> None:
    url, model = start_scripted(loop_thread, tmp_path, via, SCRIPT)
    body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
            "tools": [{"functionDeclarations": [{"name": "run_shell_command"}]}]}
    r = httpx.post(f"{url}/v1beta/models/{model}:streamGenerateContent?alt=sse", json=body,
                   headers={"User-Agent": "GeminiCLI/0.61.0/m (linux; x64; terminal)",
                            "x-goog-api-key": "k"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: {") for e in events[:-1]), r.text
    assert all("candidates" in e for e in stream_events(r.text))
    (row,) = [r for r in programs(url).values() if not r["anonymous"]]
    assert (row["agent"], row["recogniser"]) == ("gemini-cli", "conversation")


def test_a_new_prompt_continues_the_program_whose_loop_gemini_cli_signed() -> None:
    """Gemini CLI marks the model's turns of the current prompt's loop with a
    ``thoughtSignature`` and sends them unmarked once the next prompt comes: the marks
    are no part of the conversation's chain."""
    index, spec = ConversationIndex(), GEMINI_APIS[STREAM_METHOD]
    user = {"role": "user", "parts": [{"text": "List the files here."}]}
    call = {"role": "model", "parts": [
        {"functionCall": {"id": "call_1", "name": "run_shell_command", "args": {}}}]}
    signed = {"role": "model", "parts": [
        {**call["parts"][0], "thoughtSignature": "skip_thought_signature_validator"}]}
    result = {"role": "user", "parts": [{"functionResponse": {
        "id": "call_1", "name": "run_shell_command", "response": {"output": "a.txt"}}}]}
    answer = {"role": "model", "parts": [{"text": "Done."}]}
    first = index.program(spec, {"contents": [user]})
    assert first is not None
    index.done("", first)
    assert index.program(spec, {"contents": [user, signed, result]}) == first
    index.done("", first)
    again = {"role": "user", "parts": [{"text": "Again."}]}
    assert index.program(spec, {"contents": [user, call, result, answer, again]}) == first
    assert len(index) == 1


# -- errors ---------------------------------------------------------------------------------
def start_fake(lt: LoopThread, fake: FakeEngine, **settings: Any) -> Running:
    eng = lt.serve(fake.app())
    adapter = OpenAIHTTPAdapter(eng.url, kv_tokens=100_000, page_tokens=16, timeout_s=30,
                                connect_timeout_s=1.0)
    settings.setdefault("health_interval_s", 0.1)
    return lt.serve(create_app(GatewaySettings(**settings), [adapter]))


def stream_events(text: str) -> list[dict[str, Any]]:
    """A Gemini stream's chunks (``data:`` events) and its error (raw JSON, as the API
    sends one)."""
    return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e]


def gemini_error(r: httpx.Response, status: int, name: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["status"]) == (status, name), err
    message: str = err["message"]
    return message


GEN = "/v1beta/models/fake-model:generateContent"
STREAM = "/v1beta/models/fake-model:streamGenerateContent?alt=sse"
HI = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}


@pytest.mark.parametrize("body,needle", [
    (b"{nope", "not valid JSON"),
    (b"[]", "JSON object"),
    (b"{}", "contents"),
    (b'{"contents": [{"role": "bot", "parts": []}]}', "contents[0].role"),
    (b'{"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": -1}}',
     "maxOutputTokens"),
    (b'{"contents": [{"parts": [{"text": "x"}]}], "tools": [{"codeExecution": {}}]}',
     "codeExecution"),
])
def test_bad_bodies_are_a_400_in_the_gemini_shape(loop_thread: LoopThread, body: bytes,
                                                  needle: str) -> None:
    fake = FakeEngine()
    gw = start_fake(loop_thread, fake)
    for path in (GEN, STREAM):
        r = httpx.post(gw.url + path, content=body, headers={"content-type": "application/json"})
        assert needle in gemini_error(r, 400, "INVALID_ARGUMENT")
    assert fake.requests == []  # nothing reached the engine
    c = client(gw.url)  # kept: a client that is collected closes its connections
    with pytest.raises(genai_errors.ClientError) as e:  # as the SDK reports it
        c.models.generate_content(model="fake-model", contents="hi",
                                  config=types.GenerateContentConfig(candidate_count=2))
    assert e.value.code == 400 and "candidateCount" in str(e.value)


def test_paths_methods_and_models_in_the_gemini_shape(loop_thread: LoopThread) -> None:
    gw = start_fake(loop_thread, FakeEngine())
    r = httpx.post(gw.url + "/v1beta/models/fake-model:streamGenerateContent", json=HI)
    assert "alt=sse" in gemini_error(r, 400, "INVALID_ARGUMENT")
    r = httpx.post(gw.url + "/v1beta/models/fake-model:embedContent", json=HI)
    assert "embedContent" in gemini_error(r, 404, "NOT_FOUND")
    r = httpx.post(gw.url + "/v1beta/models/gemini-2.5-pro:generateContent", json=HI)
    assert "--model-alias" in gemini_error(r, 404, "NOT_FOUND")
    r = httpx.get(gw.url + GEN)
    gemini_error(r, 405, "UNIMPLEMENTED")
    assert "POST" in r.headers["allow"]
    # the v1 paths are served too, and the path's model is the one asked of the engine
    r = httpx.post(gw.url + "/v1/models/fake-model:generateContent", json=HI)
    assert r.status_code == 200 and r.json()["candidates"][0]["content"]["parts"]
    r = httpx.post(gw.url + "/v1beta/models/fake-model:countTokens",
                   json={"generateContentRequest": {"model": "models/fake-model", **HI}})
    assert r.status_code == 200 and r.json()["totalTokens"] >= 1
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'endpoint="/v1beta/models/{model}:generateContent",status="200"' in metrics


def test_keys_are_read_from_x_goog_api_key(loop_thread: LoopThread) -> None:
    gw = start_fake(loop_thread, FakeEngine(), api_keys=("sk-team",))
    r = httpx.post(gw.url + GEN, json=HI)
    assert "x-goog-api-key" in gemini_error(r, 401, "UNAUTHENTICATED")
    r = httpx.post(gw.url + GEN, json=HI, headers={"x-goog-api-key": "wrong"})
    gemini_error(r, 401, "UNAUTHENTICATED")
    c = client(gw.url, key="sk-team")
    reply = c.models.generate_content(model="fake-model", contents="hello")
    assert reply.text == "w w w w w w w w "


def test_what_the_engine_is_asked(loop_thread: LoopThread) -> None:
    fake = FakeEngine()
    gw = start_fake(loop_thread, fake)
    body = {"systemInstruction": {"parts": [{"text": "sys"}]}, **HI,
            "generationConfig": {"maxOutputTokens": 3, "temperature": 0.1, "topP": 0.5,
                                 "stopSequences": ["x"]}}
    r = httpx.post(gw.url + STREAM, json=body)
    assert r.status_code == 200
    events = stream_events(r.text)
    assert "".join(p["text"] for e in events for p in e["candidates"][0]["content"]["parts"]
                   ) == "w w w "
    assert events[-1]["candidates"][0]["finishReason"] == "STOP"  # none said: stopped
    assert events[-1]["usageMetadata"]["candidatesTokenCount"] == 3
    (asked,) = fake.chat_bodies()
    assert asked["messages"] == [{"role": "system", "content": "sys"},
                                 {"role": "user", "content": "hello"}]
    assert (asked["max_tokens"], asked["temperature"], asked["top_p"], asked["stop"]) == (
        3, 0.1, 0.5, ["x"])
    assert asked["stream"] is True and asked["stream_options"] == {"include_usage": True}


def test_engine_failures_in_the_gemini_shape(loop_thread: LoopThread) -> None:
    fake = FakeEngine(fail=lambda body, n: 500 if n == 0 else None,
                      stream_error=lambda body, n: n == 1, die=lambda body, n: n >= 2)
    gw = start_fake(loop_thread, fake)
    r = httpx.post(gw.url + GEN, json=HI)  # an error status
    assert "boom" in gemini_error(r, 500, "INTERNAL")
    for _ in range(2):  # an error event after the first token; a stream cut off
        r = httpx.post(gw.url + STREAM, json=HI)
        assert r.status_code == 200
        assert r.text.startswith("data: ") and r.text.count('{"error": ') == 1
        assert r.text.rstrip("\n").rsplit("\n\n", 1)[-1].startswith('{"error": ')  # raw
        events = stream_events(r.text)
        assert events[0]["candidates"][0]["content"]["parts"] == [{"text": "w "}]
        err = events[-1]["error"]
        assert err["code"] >= 500 and err["status"] in ("INTERNAL", "UNAVAILABLE"), err
        assert "candidates" not in events[-1]
    # the cut-off stream marked the replica down until a probe answers (every 0.1 s):
    # wait for it, or the SDK's request would be refused (503) before reaching it
    deadline = time.monotonic() + 15
    while httpx.get(gw.url + "/healthz").json()["status"] != "ok":
        assert time.monotonic() < deadline, "the replica did not come back"
        time.sleep(0.05)
    c = client(gw.url)
    with pytest.raises(genai_errors.ServerError) as e:  # the SDK raises the stream's error
        list(c.models.generate_content_stream(model="fake-model", contents="hello"))
    assert e.value.code == 502
