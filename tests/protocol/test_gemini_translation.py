"""The Gemini API translated to the chat API and back (``mori.protocol.gemini``): requests
(each field, each refusal naming its field), complete answers, streams event by event,
errors, and the readings of a conversation for program identity."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mori.protocol.apis import (
    GEMINI_APIS,
    api_error_body,
    api_for_path,
    carries_tool_results,
    conversation_head,
    conversation_items,
    is_side_request,
    last_turn_text,
    stream_error,
)
from mori.protocol.errors import RequestError
from mori.protocol.gemini.errors import engine_error, gemini_error_body
from mori.protocol.gemini.request import count_request, to_chat
from mori.protocol.gemini.response import from_chat, translate_answer, usage_metadata
from mori.protocol.gemini.routes import COUNT, GENERATE, STREAM, gemini_route
from mori.protocol.gemini.stream import GeminiStream

SHELL_DECL = {"name": "run_shell_command", "description": "Runs a shell command",
              "parametersJsonSchema": {"type": "object",
                                       "properties": {"command": {"type": "string"}},
                                       "required": ["command"]}}
USER = {"role": "user", "parts": [{"text": "<session_context>ctx</session_context>"},
                                  {"text": "List the files here."}]}
CALL = {"role": "model", "parts": [
    {"text": "Listing."},
    {"functionCall": {"id": "call_abc", "name": "run_shell_command",
                      "args": {"command": "ls"}},
     "thoughtSignature": "skip_thought_signature_validator"}]}
RESULT = {"role": "user", "parts": [{"functionResponse": {
    "id": "call_abc", "name": "run_shell_command", "response": {"output": "marker.txt"}}}]}


def body(*contents: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"systemInstruction": {"parts": [{"text": "You are Gemini CLI."}]},
            "tools": [{"functionDeclarations": [SHELL_DECL]}],
            "contents": list(contents), **extra}


# -- paths ----------------------------------------------------------------------------------
def test_routes_name_the_model_and_the_method() -> None:
    r = gemini_route("/v1beta/models/Qwen/Qwen3-8B:streamGenerateContent")
    assert r is not None and (r.model, r.method) == ("Qwen/Qwen3-8B", STREAM)
    assert gemini_route("/v1/models/m:generateContent") is not None
    assert gemini_route("/v1beta/models/m") is None  # no method
    assert gemini_route("/v1/chat/completions") is None
    assert api_for_path("/v1beta/models/m:generateContent") is GEMINI_APIS[GENERATE]
    assert api_for_path("/v1beta/models/m:countTokens") is GEMINI_APIS[COUNT]
    assert not GEMINI_APIS[COUNT].generates and GEMINI_APIS[STREAM].streams
    assert api_for_path("/v1beta/models/m:embedContent") is None


# -- requests -------------------------------------------------------------------------------
def test_a_conversation_with_a_function_call_and_its_response() -> None:
    chat = to_chat(body(USER, CALL, RESULT), "served", stream=False)
    assert chat["model"] == "served" and "stream" not in chat
    assert chat["messages"] == [
        {"role": "system", "content": "You are Gemini CLI."},
        {"role": "user", "content": "<session_context>ctx</session_context>\n"
                                    "List the files here."},
        {"role": "assistant", "content": "Listing.", "tool_calls": [
            {"id": "call_abc", "type": "function",
             "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "marker.txt"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "run_shell_command", "description": "Runs a shell command",
        "parameters": SHELL_DECL["parametersJsonSchema"]}}]


def test_calls_without_ids_pair_with_responses_by_name_and_place() -> None:
    call = {"role": "model", "parts": [
        {"functionCall": {"name": "a", "args": {}}},
        {"functionCall": {"name": "b"}}, {"functionCall": {"name": "a", "args": {"x": 1}}}]}
    result = {"role": "user", "parts": [
        {"functionResponse": {"name": "a", "response": {"output": "1"}}},
        {"functionResponse": {"name": "a", "response": {"error": "no"}}},
        {"functionResponse": {"name": "b", "response": {}}},
        {"text": "and then?"}]}
    chat = to_chat(body(USER, call, result), "m", stream=True)
    assistant = chat["messages"][2]
    ids = [c["id"] for c in assistant["tool_calls"]]
    assert ids == ["call_1_0", "call_1_1", "call_1_2"] and assistant["content"] is None
    tools = chat["messages"][3:6]
    assert [t["tool_call_id"] for t in tools] == ["call_1_0", "call_1_2", "call_1_1"]
    assert [t["content"] for t in tools] == ["1", '{"error":"no"}', "{}"]
    assert chat["messages"][6] == {"role": "user", "content": "and then?"}  # after them
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    # the same body gives the same ids: a conversation's turns translate alike each time
    assert to_chat(body(USER, call, result), "m", stream=True) == chat


def test_thoughts_images_and_a_string_system_instruction() -> None:
    thought = {"role": "model", "parts": [{"text": "hmm", "thought": True}, {"text": "Hi."}]}
    image = {"role": "user", "parts": [
        {"text": "look"}, {"inlineData": {"mimeType": "image/png", "data": "AAAA"}},
        {"fileData": {"mimeType": "image/jpeg", "fileUri": "https://x/y.jpg"}}]}
    chat = to_chat({"systemInstruction": "Be brief.", "contents": [USER, thought, image]},
                   "m", stream=False)
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][2] == {"role": "assistant", "content": "Hi."}
    assert chat["messages"][3]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://x/y.jpg"}}]
    assert "tools" not in chat


def test_generation_config_and_tool_config() -> None:
    cfg = {"temperature": 0.2, "topP": 0.9, "topK": 40, "maxOutputTokens": 512,
           "stopSequences": ["END"], "seed": 7, "presencePenalty": 0.1,
           "frequencyPenalty": 0.3, "candidateCount": 1,
           "thinkingConfig": {"includeThoughts": True},
           "responseMimeType": "application/json",
           "responseSchema": {"type": "OBJECT", "nullable": True,
                              "properties": {"n": {"type": "INTEGER"}},
                              "propertyOrdering": ["n"]}}
    tool_config = {"functionCallingConfig": {"mode": "ANY",
                                             "allowedFunctionNames": ["run_shell_command"]}}
    chat = to_chat(body(USER, generationConfig=cfg, toolConfig=tool_config), "m", False)
    assert {k: chat[k] for k in ("temperature", "top_p", "top_k", "max_tokens", "stop",
                                 "seed", "presence_penalty", "frequency_penalty")} == {
        "temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 512, "stop": ["END"],
        "seed": 7, "presence_penalty": 0.1, "frequency_penalty": 0.3}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "response", "schema": {"type": ["object", "null"],
                                       "properties": {"n": {"type": "integer"}}}}}
    assert chat["tool_choice"] == {"type": "function",
                                   "function": {"name": "run_shell_command"}}
    for mode, choice in (("AUTO", "auto"), ("NONE", "none"), ("ANY", "required")):
        tc = {"functionCallingConfig": {"mode": mode}}
        assert to_chat(body(USER, toolConfig=tc), "m", False)["tool_choice"] == choice
    plain = to_chat(body(USER, generationConfig={"responseMimeType": "application/json"}),
                    "m", False)
    assert plain["response_format"] == {"type": "json_object"}


def test_openapi_parameters_become_json_schema() -> None:
    decl = {"name": "f", "parameters": {"type": "OBJECT", "properties": {
        "xs": {"type": "ARRAY", "items": {"type": "STRING", "enum": ["a"]}},
        "o": {"type": "STRING", "nullable": True}}, "required": ["xs"]}}
    chat = to_chat({"contents": [USER], "tools": [{"functionDeclarations": [decl, {
        "name": "g"}]}]}, "m", False)
    params = chat["tools"][0]["function"]["parameters"]
    assert params == {"type": "object", "required": ["xs"], "properties": {
        "xs": {"type": "array", "items": {"type": "string", "enum": ["a"]}},
        "o": {"type": ["string", "null"]}}}
    assert chat["tools"][1]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(("bad", "param"), [
    ({"contents": []}, "contents"),
    ({"contents": "hi"}, "contents"),
    ({"contents": [3]}, "contents[0]"),
    ({"contents": [{"role": "user"}]}, "contents[0].parts"),
    ({"contents": [{"role": "assistant", "parts": []}]}, "contents[0].role"),
    ({"contents": [{"parts": [{"text": 5}]}]}, "contents[0].parts[0].text"),
    ({"contents": [{"parts": ["hi"]}]}, "contents[0].parts[0]"),
    ({"contents": [{"parts": [{"executableCode": {"code": "1"}}]}]},
     "contents[0].parts[0].executableCode"),
    ({"contents": [{"parts": [{"inlineData": {"mimeType": "application/pdf", "data": "x"}}]}]},
     "contents[0].parts[0].inlineData"),
    ({"contents": [{"parts": [{"functionCall": {"name": "f"}}]}]},
     "contents[0].parts[0].functionCall"),
    ({"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]},
     "contents[0].parts[0].functionCall.name"),
    ({"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": []}}]}]},
     "contents[0].parts[0].functionCall.args"),
    ({"contents": [{"parts": [{"functionResponse": {"name": "f", "response": {}}}]}]},
     "contents[0].parts[0]"),
    ({"contents": [{"parts": [{"functionResponse": {"response": {}}}]}]},
     "contents[0].parts[0].functionResponse.name"),
    ({"contents": [USER], "systemInstruction": 3}, "systemInstruction"),
    ({"contents": [USER], "tools": {}}, "tools"),
    ({"contents": [USER], "tools": [{"googleSearch": {}}]}, "tools[0].googleSearch"),
    ({"contents": [USER], "tools": [{"functionDeclarations": [{"description": "x"}]}]},
     "tools[0].functionDeclarations[0].name"),
    ({"contents": [USER], "generationConfig": []}, "generationConfig"),
    ({"contents": [USER], "generationConfig": {"temperature": "hot"}},
     "generationConfig.temperature"),
    ({"contents": [USER], "generationConfig": {"maxOutputTokens": 0}},
     "generationConfig.maxOutputTokens"),
    ({"contents": [USER], "generationConfig": {"stopSequences": ["a", 1]}},
     "generationConfig.stopSequences"),
    ({"contents": [USER], "generationConfig": {"candidateCount": 2}},
     "generationConfig.candidateCount"),
    ({"contents": [USER], "toolConfig": {"functionCallingConfig": {"mode": "SOME"}}},
     "toolConfig.functionCallingConfig.mode"),
    ({"contents": [USER], "cachedContent": "cachedContents/x"}, "cachedContent"),
])
def test_a_body_that_cannot_be_translated_is_a_400_naming_the_field(
        bad: dict[str, Any], param: str) -> None:
    with pytest.raises(RequestError) as e:
        to_chat(bad, "m", stream=False)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert param in e.value.message


def test_count_tokens_counts_a_generate_content_request() -> None:
    inner = body(USER)
    assert count_request({"generateContentRequest": inner}) is inner
    assert count_request({"contents": [USER]}) == {"contents": [USER]}
    with pytest.raises(RequestError):
        count_request({"generateContentRequest": []})


# -- complete answers -------------------------------------------------------------------------
CHAT_CALL = {"id": "chatcmpl-1", "object": "chat.completion", "model": "served",
             "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                 "role": "assistant", "content": "Listing.", "reasoning_content": "think",
                 "tool_calls": [{"id": "call_9", "type": "function", "function": {
                     "name": "run_shell_command", "arguments": '{"command": "ls"}'}}]}}],
             "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
                       "prompt_tokens_details": {"cached_tokens": 64},
                       "completion_tokens_details": {"reasoning_tokens": 2}}}


def test_a_chat_answer_as_a_generate_content_response() -> None:
    out = from_chat(CHAT_CALL)
    (cand,) = out["candidates"]
    assert cand["content"] == {"role": "model", "parts": [
        {"text": "think", "thought": True}, {"text": "Listing."},
        {"functionCall": {"name": "run_shell_command", "args": {"command": "ls"},
                          "id": "call_9"}}]}
    assert cand["finishReason"] == "STOP"
    assert out["usageMetadata"] == {"promptTokenCount": 100, "candidatesTokenCount": 7,
                                    "totalTokenCount": 107, "cachedContentTokenCount": 64,
                                    "thoughtsTokenCount": 2}
    assert (out["modelVersion"], out["responseId"]) == ("served", "chatcmpl-1")


@pytest.mark.parametrize(("finish", "reason"), [("stop", "STOP"), ("length", "MAX_TOKENS"),
                                                ("content_filter", "SAFETY"),
                                                ("weird", "OTHER")])
def test_finish_reasons(finish: str, reason: str) -> None:
    chat = {"choices": [{"finish_reason": finish, "message": {"content": "x"}}]}
    assert from_chat(chat)["candidates"][0]["finishReason"] == reason


def test_odd_answers_still_translate() -> None:
    bad_args = {"choices": [{"finish_reason": "tool_calls", "message": {"tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "not json"}}]}}]}
    part = from_chat(bad_args)["candidates"][0]["content"]["parts"][0]
    assert part == {"functionCall": {"name": "f", "args": {"arguments": "not json"},
                                     "id": "c"}}
    empty = from_chat({"choices": []})
    assert empty["candidates"][0]["content"]["parts"] == [{"text": ""}]
    assert "usageMetadata" not in empty
    assert usage_metadata({"prompt_tokens": 3}) == {
        "promptTokenCount": 3, "candidatesTokenCount": 0, "totalTokenCount": 3}


def test_translate_answer_passes_errors_in_the_gemini_shape() -> None:
    status, out = translate_answer(200, json.dumps(CHAT_CALL).encode())
    assert status == 200 and json.loads(out)["candidates"]
    status, out = translate_answer(400, json.dumps(
        {"error": {"message": "bad schema", "type": "invalid_request_error"}}).encode())
    assert (status, json.loads(out)) == (400, {"error": {
        "code": 400, "message": "bad schema", "status": "INVALID_ARGUMENT"}})
    status, out = translate_answer(503, b"overloaded")
    assert json.loads(out)["error"] == {"code": 503, "message": "overloaded",
                                        "status": "UNAVAILABLE"}
    status, out = translate_answer(200, b"<html>")
    assert status == 502 and json.loads(out)["error"]["status"] == "UNAVAILABLE"


# -- streams ----------------------------------------------------------------------------------
def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode())
                    + b"\n\n" for e in events)


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-2", "model": "served", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": None, **extra}


def events(raw: bytes) -> list[dict[str, Any]]:
    """The chunks of a Gemini stream, and its error: raw JSON, as the API sends it."""
    assert raw.endswith(b"\n\n")
    out = []
    for event in raw.split(b"\n\n")[:-1]:
        if event.startswith(b"{"):
            out.append(json.loads(event))
            assert "error" in out[-1]
            continue
        assert event.startswith(b"data: "), event  # nothing but data events
        out.append(json.loads(event[6:]))
    return out


def test_a_stream_of_text_then_a_tool_call() -> None:
    s = GeminiStream()
    first = s.feed(b": kv-ready\n\n" + sse(chunk({"role": "assistant", "content": ""})))
    assert first == b""  # a comment and an empty delta: nothing to send
    text = events(s.feed(sse(chunk({"reasoning_content": "hmm"}),
                             chunk({"content": "List"}), chunk({"content": "ing."}))))
    assert [e["candidates"][0]["content"]["parts"] for e in text] == [
        [{"text": "hmm", "thought": True}], [{"text": "List"}], [{"text": "ing."}]]
    assert all(e["modelVersion"] == "served" and e["responseId"] == "chatcmpl-2"
               and "finishReason" not in e["candidates"][0] for e in text)
    # the call's arguments in pieces (cut mid-line between two feeds): sent whole, last
    calls = sse(chunk({"tool_calls": [{"index": 0, "id": "call_7", "type": "function",
                                       "function": {"name": "run_shell_command",
                                                    "arguments": '{"comm'}}]}),
                chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'and":"ls"}'}}]}),
                chunk({}, "tool_calls"))
    assert s.feed(calls) == b""
    usage = {"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59,
             "prompt_tokens_details": {"cached_tokens": 32}}
    (last,) = events(s.feed(sse({"id": "chatcmpl-2", "choices": [], "usage": usage},
                                b"[DONE]")))
    cand = last["candidates"][0]
    assert cand["content"]["parts"] == [{"functionCall": {
        "name": "run_shell_command", "args": {"command": "ls"}, "id": "call_7"}}]
    assert cand["finishReason"] == "STOP"
    assert last["usageMetadata"]["cachedContentTokenCount"] == 32
    assert last["usageMetadata"]["promptTokenCount"] == 50
    assert s.done and s.feed(sse(chunk({"content": "late"}))) == b"" and s.last() == b""


def test_a_text_stream_ends_on_an_empty_text_with_its_finish_reason() -> None:
    s = GeminiStream()
    out = events(s.feed(sse(chunk({"content": "Done."}), chunk({}, "length"))) + s.last())
    assert out[-1]["candidates"][0]["content"]["parts"] == [{"text": ""}]
    assert out[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert "usageMetadata" not in out[-1]


def test_an_engine_error_event_ends_the_stream_in_the_gemini_shape() -> None:
    s = GeminiStream()
    err = {"error": {"message": "the engine aborted the request", "type": "server_error",
                     "code": "aborted"}}
    (event,) = events(s.feed(sse(err, b"[DONE]")))
    assert event == {"error": {"code": 500, "message": "the engine aborted the request",
                               "status": "INTERNAL"}}
    assert s.done and s.last() == b""
    assert engine_error(0, {"error": {"message": "m", "type": "rate_limit_error"}}) == (
        429, "m")
    assert engine_error(0, {"error": {"message": "m", "code": 503}}) == (503, "m")
    assert engine_error(422, b'{"detail": "nope"}') == (422, "nope")


# -- errors -------------------------------------------------------------------------------------
def test_error_shapes() -> None:
    spec = GEMINI_APIS[STREAM]
    assert api_error_body(spec, 429, "wait", retry_after_s=2.4) == gemini_error_body(
        429, "wait", 2.4) == {"error": {
            "code": 429, "message": "wait", "status": "RESOURCE_EXHAUSTED",
            "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo",
                         "retryDelay": "2s"}]}}
    assert gemini_error_body(418, "teapot")["error"]["status"] == "UNKNOWN"
    event = stream_error(spec, 502, "the engine failed")
    assert event.startswith(b'{"error": ') and event.endswith(b"}\n\n")
    assert json.loads(event)["error"]["status"] == "UNAVAILABLE"


# -- the conversation, read for program identity ---------------------------------------------
def test_the_conversation_as_the_recognisers_read_it() -> None:
    spec = GEMINI_APIS[STREAM]
    first, second = body(USER), body(USER, CALL, RESULT)
    assert conversation_head(spec, first) == conversation_head(spec, second) == (
        "You are Gemini CLI.\n<session_context>ctx</session_context>\nList the files here.")
    system, items = conversation_items(spec, second)  # type: ignore[misc]
    assert system == "You are Gemini CLI."
    assert [answer for answer, _ in items] == [False, True, False]
    assert [c for _, c in items] == [USER, CALL, RESULT]
    assert carries_tool_results(spec, second) and not carries_tool_results(spec, first)
    # a new prompt after the results still follows them; a model turn after them does not
    nudge = {"role": "user", "parts": [{"text": "go on"}]}
    assert carries_tool_results(spec, body(USER, CALL, RESULT, nudge))
    assert not carries_tool_results(spec, body(USER, CALL, RESULT, CALL))
    assert last_turn_text(spec, second) == "marker.txt"
    assert last_turn_text(spec, first) == ("<session_context>ctx</session_context>\n"
                                           "List the files here.")


def test_side_requests() -> None:
    spec = GEMINI_APIS[GENERATE]
    assert is_side_request(spec, {"contents": [USER]})
    assert not is_side_request(spec, body(USER))  # tools offered
    assert not is_side_request(spec, {"contents": [USER, CALL, RESULT]})
    assert not is_side_request(spec, {"contents": "x"})
    assert not is_side_request(GEMINI_APIS[COUNT], {"contents": [USER]})  # no generation
