"""``mori.protocol``: the prompt counting rule (strict for the simulated engine, an
estimate for the gateway), MORI's request fields, OpenAI-style errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mori.protocol.errors import RequestError, error_body, sse_error
from mori.protocol.fields import CHAT, COMPLETIONS, program_id_field, synthetic_field
from mori.protocol.tokens import CHARS_PER_TOKEN, prompt_tokens, text_prompt_tokens


def chat(*contents: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": c} for c in contents]}


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("path, body, tokens", [
    (CHAT, chat("abcde", [{"type": "text", "text": "fgh"}]), 2),  # ceil(8 / 4)
    (CHAT, chat("x" * 401), 101),
    (CHAT, chat(None, ["abcd", {"type": "image_url"}]), 1),  # a bare string part counts
    (CHAT, chat(""), 1),  # at least one token
    (COMPLETIONS, {"prompt": "y" * 40}, 10),
    (COMPLETIONS, {"prompt": ["y" * 9]}, 3),  # a batch of one
    (COMPLETIONS, {"prompt": [1, 2, 3]}, 3),  # token ids
    (COMPLETIONS, {"prompt": [[1, 2, 3, 4, 5]]}, 5),
])
def test_text_rule(path: str, body: dict[str, Any], tokens: int, strict: bool) -> None:
    assert CHARS_PER_TOKEN == 4
    assert text_prompt_tokens(path, body, strict=strict) == tokens


@pytest.mark.parametrize("path, body, estimate, param", [
    (CHAT, {"messages": []}, 1, "messages"),
    (CHAT, {"messages": ["hi"]}, 1, "messages"),
    (CHAT, chat("abcd", {"text": "x"}), 1, "messages"),  # a content that is no text: 0 chars
    (COMPLETIONS, {"prompt": ["ab", "cdefgh"]}, 2, "prompt"),  # a batch: 8 characters
    (COMPLETIONS, {"prompt": ["abcdef", 7]}, 3, "prompt"),  # a non-string: one token
    (COMPLETIONS, {"prompt": []}, 1, "prompt"),
    (COMPLETIONS, {}, 1, "prompt"),
])
def test_what_the_engine_refuses_the_gateway_estimates(path: str, body: dict[str, Any],
                                                       estimate: int, param: str) -> None:
    with pytest.raises(RequestError) as e:
        text_prompt_tokens(path, body)
    assert (e.value.status, e.value.param, e.value.type) == (400, param,
                                                            "invalid_request_error")
    assert text_prompt_tokens(path, body, strict=False) == estimate


def test_synthetic_size_comes_first() -> None:
    assert prompt_tokens(CHAT, {**chat("hi"), "mori": {"prompt_tokens": 9000}}) == 9000
    assert prompt_tokens(CHAT, {**chat("hi"), "mori": {"prompt_tokens": 0}}) == 1
    assert prompt_tokens(CHAT, {**chat("hi"), "mori": {"reuse_tokens": 5}}) == 1
    assert prompt_tokens(COMPLETIONS, {"prompt": 7, "mori": {"prompt_tokens": 12}}) == 12


def test_mori_fields() -> None:
    assert synthetic_field({"prompt_tokens": 10, "reuse_tokens": 4, "other": 1}) == {
        "prompt_tokens": 10, "reuse_tokens": 4}
    assert synthetic_field({}) == {}
    for bad, param in (([1], "mori"), ({"prompt_tokens": -1}, "mori.prompt_tokens"),
                       ({"reuse_tokens": True}, "mori.reuse_tokens"),
                       ({"prompt_tokens": "many"}, "mori.prompt_tokens")):
        with pytest.raises(RequestError) as e:
            synthetic_field(bad)
        assert e.value.status == 400 and e.value.param == param
        assert param in e.value.message
    assert program_id_field(None) is None and program_id_field("p") == "p"
    for bad_id in ("", 7):
        with pytest.raises(RequestError, match="program_id"):
            program_id_field(bad_id)


def test_error_bodies() -> None:
    assert error_body(404, "gone", "model", "model_not_found") == {"error": {
        "message": "gone", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}}
    assert error_body(503, "busy")["error"]["type"] == "service_unavailable"
    assert error_body(503, "busy", type_="server_error")["error"]["type"] == "server_error"
    assert error_body(418, "?")["error"]["type"] == "api_error"
    e = RequestError(503, "full", code="overloaded", type_="server_error")
    r = e.response()
    assert r.status_code == 503 and json.loads(bytes(r.body)) == e.body() == {"error": {
        "message": "full", "type": "server_error", "param": None, "code": "overloaded"}}
    assert sse_error(502, "died").endswith(b"data: [DONE]\n\n")
    assert json.loads(sse_error(502, "died").split(b"\n\n")[0][6:])["error"]["type"] == (
        "upstream_error")
