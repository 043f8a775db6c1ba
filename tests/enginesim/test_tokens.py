"""The text rule (``mori.protocol.tokens``) for Anthropic Messages and OpenAI Responses
bodies: what counts, strict errors that name the field (the engine), and the gateway's
estimate, which never raises."""

from __future__ import annotations

import math
from typing import Any

import pytest

from mori.protocol.errors import RequestError
from mori.protocol.fields import CHAT, COUNT_TOKENS, MESSAGES, RESPONSES
from mori.protocol.tokens import compact_json, text_prompt_tokens

TOOL = {"name": "Bash", "input_schema": {"type": "object"}}


def test_messages_count_text_tool_calls_results_and_tools() -> None:
    body: dict[str, Any] = {
        "system": [{"type": "text", "text": "s" * 10}], "tools": [TOOL],
        "messages": [
            {"role": "user", "content": "u" * 7},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "not counted", "signature": "x"},
                {"type": "text", "text": "a" * 5},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "r" * 3},
                {"type": "tool_result", "tool_use_id": "t2",
                 "content": [{"type": "text", "text": "q" * 2}, {"type": "image"}]},
                {"type": "image", "source": {}}, {"type": "text", "text": "t" * 4}]}]}
    chars = 10 + len(compact_json(TOOL)) + 7 + 5 + 4 + len('{"command":"ls"}') + 3 + 2 + 4
    for path in (MESSAGES, MESSAGES + "?beta=true", COUNT_TOKENS):
        assert text_prompt_tokens(path, body) == math.ceil(chars / 4)
        assert text_prompt_tokens(path, body, strict=False) == math.ceil(chars / 4)


def test_responses_count_items_and_tools() -> None:
    body: dict[str, Any] = {
        "instructions": "i" * 9, "tools": [{"type": "function", "name": "shell"}],
        "input": [
            {"role": "user", "content": "u" * 4},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "v" * 3}, {"type": "input_image"}]},
            {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "o" * 6},
            {"type": "custom_tool_call", "call_id": "d", "name": "ap", "input": "p" * 5},
            {"type": "custom_tool_call_output", "call_id": "d",
             "output": [{"type": "input_text", "text": "w" * 2}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r" * 8}]},
            {"type": "item_reference", "id": "x"}]}
    chars = 9 + len(compact_json(body["tools"][0])) + 4 + 3 + 5 + 2 + 6 + 2 + 5 + 2 + 8
    assert text_prompt_tokens(RESPONSES, body) == math.ceil(chars / 4)
    assert text_prompt_tokens(RESPONSES, {"input": "x" * 41}) == 11


@pytest.mark.parametrize("path, body, param, estimate", [
    (MESSAGES, {"messages": []}, "messages", 1),
    (MESSAGES, {"messages": [{"role": "user", "content": "abcd"}, "hi"]}, "messages[1]", 1),
    (MESSAGES, {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages[0].content[0]", 1),
    (MESSAGES, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text", 1),
    (MESSAGES, {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     "messages[0].content[0].content", 1),
    (MESSAGES, {"tools": {"name": "x"}, "messages": [{"role": "user", "content": "a" * 8}]},
     "tools", 2),
    (COUNT_TOKENS, {"system": [1], "messages": [{"role": "user", "content": "a" * 8}]},
     "system[0]", 2),
    (RESPONSES, {}, "input", 1),
    (RESPONSES, {"input": [{"role": "user", "content": "a" * 12}, 3]}, "input[1]", 3),
    (RESPONSES, {"input": [{"type": "function_call_output", "output": 3}]},
     "input[0].output", 1),
    (RESPONSES, {"input": [{"type": "reasoning", "summary": "s"}]}, "input[0].summary", 1),
    (RESPONSES, {"input": "abcd", "tools": [3]}, "tools[0]", 1),
])
def test_the_engine_names_the_field_the_gateway_estimates(path: str, body: dict[str, Any],
                                                          param: str, estimate: int) -> None:
    with pytest.raises(RequestError) as e:
        text_prompt_tokens(path, body)
    assert (e.value.status, e.value.param) == (400, param)
    assert f"'{param}'" in e.value.message
    assert text_prompt_tokens(path, body, strict=False) == estimate


def test_chat_ignores_tools_and_query_strings() -> None:
    body = {"messages": [{"role": "user", "content": "abcdefgh"}], "tools": [TOOL]}
    assert text_prompt_tokens(CHAT, body) == 2
    assert text_prompt_tokens(CHAT + "?x=1", body) == 2
