"""Fuzzing one running gateway (``mori serve``'s app, a simulated engine behind it) with
random request bodies, program ids and headers, on every path it serves (chat and
completions, Anthropic's Messages and its token counting, OpenAI's Responses): it never
answers 5xx, every 4xx comes in the shape of the API the request came in on (Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on the Messages paths, OpenAI's
``{"error": {"message", ...}}`` elsewhere) with a message, it still serves a good request
on each path afterwards, and no program is left Reasoning or with a request in flight."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_harness import LoopThread, serve_on_simulated
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mori.gateway.config import GatewaySettings
from mori.gateway.parsing import (
    MAX_INT_DIGITS,
    MAX_JSON_DEPTH,
    _check_tree,
    decode_body,
    may_break_limits,
)
from mori.protocol.errors import RequestError

PATHS = ("/v1/chat/completions", "/v1/completions")
MESSAGES, COUNT_TOKENS, RESPONSES = ("/v1/messages", "/v1/messages/count_tokens",
                                     "/v1/responses")
AGENT_PATHS = (MESSAGES, MESSAGES + "?beta=true", COUNT_TOKENS, RESPONSES)
HTTP_PARSER_REFUSAL = "Invalid HTTP request received."  # uvicorn's plain-text 400
FUZZ = settings(deadline=None, max_examples=60, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Target:
    def __init__(self, url: str, model: str, client: httpx.Client) -> None:
        self.url, self.model, self.client = url, model, client
        self.statuses: dict[int, int] = {}
        self.refused_by_server = 0
        self.by_path: dict[str, dict[int, int]] = {}

    def send(self, path: str, content: bytes, headers: dict[str, Any] | None = None
             ) -> httpx.Response:
        try:
            r = self.client.post(self.url + path, content=content,
                                 headers={"content-type": "application/json", **(headers or {})})
        except httpx.LocalProtocolError:  # a header the client itself refuses to send
            assume(False)
            raise
        self.statuses[r.status_code] = self.statuses.get(r.status_code, 0) + 1
        seen = self.by_path.setdefault(path.split("?", 1)[0], {})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        why = (r.status_code, r.text[:500], path, content[:300], headers)
        assert r.status_code < 500, why
        if r.status_code == 400 and r.text == HTTP_PARSER_REFUSAL:
            # the HTTP server's parser refused the request (a control character in a
            # header value): it never reached the gateway, and the connection is closed
            self.refused_by_server += 1
            return r
        if r.status_code >= 400:
            assert_error_shape(path, r.json(), why)
        return r


def assert_error_shape(path: str, body: Any, why: Any = None) -> None:
    """An error body in the shape of ``path``'s API, with a message."""
    if path.split("?", 1)[0].startswith(MESSAGES):
        assert isinstance(body, dict) and body.get("type") == "error", why
        err = body.get("error")
        assert isinstance(err, dict) and isinstance(err.get("type"), str) and err["type"], why
    else:
        assert isinstance(body, dict) and "type" not in body, why
        err = body.get("error")
        assert isinstance(err, dict), why
    assert isinstance(err.get("message"), str) and err["message"].strip(), why


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    lt = LoopThread()
    url = serve_on_simulated(lt, GatewaySettings(time_scale=100.0, hold_timeout_s=30)).url
    with httpx.Client(timeout=30) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]
        try:
            yield Target(url, model, client)
        finally:
            lt.close()


# -- strategies ------------------------------------------------------------------------------

# every code point, lone surrogates included (json.dumps writes them as \ud800 escapes)
any_char = st.characters(exclude_categories=())
weird_text = st.text(any_char, max_size=12)
ids = st.one_of(
    weird_text,
    st.text(st.sampled_from("ab-é程序\r\n\x00\t\u2028\x85 /%"), min_size=0, max_size=10),
    st.text(any_char, min_size=250, max_size=270),
    st.just("anon-1"), st.integers(), st.none(), st.lists(st.integers(), max_size=2),
)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                         st.integers(min_value=10 ** 90, max_value=10 ** 110), weird_text)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(weird_text, inner, max_size=4)),
    max_leaves=12)
small_or_bad_int = st.one_of(st.integers(-3, 4), st.integers(10 ** 7, 10 ** 120),
                             st.booleans(), weird_text, st.none())


good_ids = st.text(st.sampled_from("ab-é程序 /%?#✓"), min_size=1, max_size=12).filter(
    lambda t: not t.startswith("anon-"))


@st.composite
def chat_like(draw: st.DrawFn, model: str) -> tuple[str, dict[str, Any]]:
    """A body close to a valid request: each field is good, left out, or (one time in
    ten) replaced by something odd."""
    path = draw(st.sampled_from(PATHS))
    chat = path == PATHS[0]
    fields: list[tuple[str, st.SearchStrategy[Any], st.SearchStrategy[Any]]] = [
        ("model", st.just(model), json_values),
        ("messages", st.just([{"role": "user", "content": "hi"}]), st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.one_of(st.just("user"), json_values)},
                                           optional={"content": json_values}), max_size=3),
            json_values)) if chat else
        ("prompt", st.one_of(st.text(max_size=20), st.lists(st.integers(0, 50_000),
                                                            min_size=1, max_size=5)),
         json_values),
        ("max_tokens", st.integers(1, 4), small_or_bad_int),
        ("stream", st.booleans(), json_scalars),
        ("stream_options", st.just({"include_usage": True}), json_values),
        ("program_id", good_ids, ids),
        ("mori", st.fixed_dictionaries({}, optional={"prompt_tokens": st.integers(1, 3000)}),
         st.one_of(st.fixed_dictionaries({}, optional={"prompt_tokens": small_or_bad_int,
                                                       "reuse_tokens": small_or_bad_int}),
                   json_values)),
        ("n", st.just(1), small_or_bad_int),
    ]
    body: dict[str, Any] = {}
    for key, good, odd in fields:
        how = draw(st.integers(0, 9))
        if how < 1:
            body[key] = draw(odd)
        elif how < 8 or key in ("model", "messages", "prompt"):
            body[key] = draw(good)
    return path, body


headers = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"X-Program-Id": st.one_of(
        st.binary(max_size=40), weird_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.text(st.sampled_from("程序é-x"), max_size=8).map(str.encode))}),
)


# -- the fuzz --------------------------------------------------------------------------------

@settings(FUZZ, max_examples=90)
@given(data=st.data())
def test_chat_like_bodies_never_5xx(target: Target, data: st.DataObject) -> None:
    path, body = data.draw(chat_like(target.model))
    raw = json.dumps(body).encode()  # NaN / Infinity written as such: not JSON
    target.send(path, raw, data.draw(headers))


@settings(FUZZ, max_examples=50)
@given(path=st.sampled_from(PATHS), value=json_values, hdrs=headers)
def test_random_json_never_5xx(target: Target, path: str, value: Any,
                               hdrs: dict[str, Any]) -> None:
    target.send(path, json.dumps(value).encode(), hdrs)


@settings(FUZZ, max_examples=60)
@given(path=st.sampled_from(PATHS), raw=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda a, b, n: a * n + b * n, st.sampled_from([b"[", b"{\"a\":"]),
              st.sampled_from([b"]", b"}"]), st.integers(100, 3000)),
    st.integers(90, 6000).map(lambda n: b'{"model": "m", "prompt": "x", "max_tokens": '
                              + b"7" * n + b"}")), hdrs=headers)
def test_random_bytes_never_5xx(target: Target, path: str, raw: bytes,
                                hdrs: dict[str, Any]) -> None:
    target.send(path, raw, hdrs)


# -- the agents' APIs: Anthropic's Messages and token counting, OpenAI's Responses --------

def sometimes_odd(draw: st.DrawFn, fields: list[tuple[str, st.SearchStrategy[Any],
                                                       st.SearchStrategy[Any]]],
                  always: tuple[str, ...] = ()) -> dict[str, Any]:
    """A body of ``fields``: each good, left out (unless in ``always``), or (one time in
    ten) replaced by something odd."""
    body: dict[str, Any] = {}
    for key, good, odd in fields:
        how = draw(st.integers(0, 9))
        if how < 1:
            body[key] = draw(odd)
        elif how < 7 or key in always:
            body[key] = draw(good)
    return body


SYNTHETIC: list[tuple[str, st.SearchStrategy[Any], st.SearchStrategy[Any]]] = [
    ("program_id", good_ids, ids),
    ("mori", st.fixed_dictionaries({}, optional={"prompt_tokens": st.integers(1, 3000)}),
     st.one_of(st.fixed_dictionaries({}, optional={"prompt_tokens": small_or_bad_int,
                                                   "reuse_tokens": small_or_bad_int}),
               json_values)),
]
"""MORI's own fields, which every model-calling API takes."""
short_text = st.one_of(st.just("hi"), st.text(max_size=12), weird_text)
# a session id as Claude Code puts it in metadata.user_id (a JSON string), or not quite
session_ids = st.one_of(ids, st.text(st.sampled_from("0123456789abcdef-"), min_size=1,
                                     max_size=40))
user_ids = st.one_of(
    session_ids.map(lambda s: json.dumps({"device_id": "d" * 8, "account_uuid": "",
                                          "session_id": s})),
    json_values.map(lambda v: json.dumps({"session_id": v})),
    json_values.map(json.dumps),
    session_ids.map(lambda s: f"user_{'a' * 8}_account__session_{s}"),
    st.just('{"session_id": "x"'), weird_text)
# a block with a string type (it passes the gateway's checks) and odd fields
odd_block = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking",
                                        "document", ""]), weird_text)},
    optional={"text": json_values, "id": json_values, "name": json_values,
              "input": json_values, "tool_use_id": json_values, "content": json_values,
              "cache_control": json_values, "source": json_values})
bad_block = st.one_of(json_values, st.fixed_dictionaries({}, optional={
    "type": json_values, "text": json_values}))
good_block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": short_text},
                          optional={"cache_control": st.just({"type": "ephemeral"})}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.just("toolu_1"),
                           "name": st.just("Bash"), "input": st.just({"command": "ls"})}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("toolu_1"),
                           "content": st.one_of(short_text, st.just(
                               [{"type": "text", "text": "a.txt"}]))},
                          optional={"is_error": st.booleans()}))
anthropic_content = st.one_of(short_text, st.lists(st.one_of(good_block, odd_block),
                                                   min_size=1, max_size=3))
odd_anthropic_content = st.one_of(json_values, st.lists(st.one_of(
    good_block, odd_block, bad_block), min_size=1, max_size=3))
anthropic_messages = st.one_of(
    st.just([{"role": "user", "content": "hi"}]),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"])},
                                   optional={"content": anthropic_content}),
             min_size=1, max_size=3))
odd_anthropic_messages = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(
        ["user", "assistant", "system", "tool"]), json_values)},
        optional={"content": st.one_of(anthropic_content, odd_anthropic_content)}),
        max_size=3),
    json_values)
anthropic_tools = st.lists(st.one_of(
    st.just({"name": "Bash", "description": "Run a shell command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}}}),
    st.fixed_dictionaries({}, optional={"name": json_values, "description": json_values,
                                        "input_schema": json_values, "type": json_values})),
    max_size=3)
system_prompts = st.one_of(short_text, st.lists(good_block, max_size=2))


@st.composite
def messages_like(draw: st.DrawFn, model: str, count: bool = False) -> dict[str, Any]:
    """A Messages body (or, ``count``, a token counting one) close to a valid one."""
    fields: list[tuple[str, st.SearchStrategy[Any], st.SearchStrategy[Any]]] = [
        ("model", st.just(model), json_values),
        ("messages", anthropic_messages, odd_anthropic_messages),
        ("system", system_prompts, st.one_of(json_values, st.lists(
            st.one_of(odd_block, bad_block), max_size=2))),
        ("tools", anthropic_tools, json_values),
        ("tool_choice", st.just({"type": "auto"}), json_values),
    ]
    if not count:
        fields += [
            ("max_tokens", st.integers(1, 4), small_or_bad_int),
            ("stream", st.booleans(), json_scalars),
            ("metadata", st.fixed_dictionaries({"user_id": user_ids}),
             st.one_of(json_values, st.fixed_dictionaries({"user_id": json_values}))),
            ("temperature", st.just(1), json_scalars),
            ("stop_sequences", st.just(["\n\nHuman:"]), json_values),
            ("thinking", st.just({"type": "enabled", "budget_tokens": 1024}), json_values),
            *SYNTHETIC,
        ]
    return sometimes_odd(draw, fields, ("model", "messages") + (() if count else
                                                                ("max_tokens",)))


response_items = st.one_of(
    st.just({"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "hi"}]}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "system",
                                                    "assistant"]),
                           "content": st.one_of(short_text, st.lists(
                               st.fixed_dictionaries({"type": st.sampled_from(
                                   ["input_text", "output_text"]), "text": short_text}),
                               max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"),
                           "name": st.just("shell"), "arguments": st.just('{"command":["ls"]}')}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.just("call_1"), "output": short_text}),
    st.just({"type": "reasoning", "summary": [], "encrypted_content": "xyz"}),
    st.fixed_dictionaries({}, optional={
        "type": st.one_of(st.sampled_from(["message", "function_call", "function_call_output",
                                           "custom_tool_call_output", "reasoning",
                                           "local_shell_call_output", "tool_result"]),
                          json_values),
        "role": json_values, "content": json_values, "output": json_values,
        "call_id": json_values, "name": json_values, "arguments": json_values}))
response_tools = st.lists(st.one_of(
    st.just({"type": "function", "name": "shell", "description": "Run a command",
             "parameters": {"type": "object", "properties": {}}}),
    st.just({"type": "web_search"}),
    st.fixed_dictionaries({}, optional={"type": json_values, "name": json_values,
                                        "parameters": json_values})), max_size=3)


@st.composite
def responses_like(draw: st.DrawFn, model: str) -> dict[str, Any]:
    """A Responses body (Codex-like) close to a valid one."""
    fields: list[tuple[str, st.SearchStrategy[Any], st.SearchStrategy[Any]]] = [
        ("model", st.just(model), json_values),
        ("input", st.one_of(short_text, st.lists(response_items, min_size=1, max_size=4)),
         st.one_of(json_values, st.lists(json_values, max_size=3))),
        ("instructions", short_text, json_values),
        ("prompt_cache_key", st.one_of(good_ids, session_ids.filter(
            lambda v: isinstance(v, str))), ids),
        ("tools", response_tools, json_values),
        ("tool_choice", st.just("auto"), json_values),
        ("max_output_tokens", st.integers(1, 4), small_or_bad_int),
        ("stream", st.booleans(), json_scalars),
        ("store", st.just(False), json_values),
        ("include", st.just(["reasoning.encrypted_content"]), json_values),
        ("reasoning", st.just({"effort": "low", "summary": "auto"}), json_values),
        ("previous_response_id", st.just("resp_1"), json_values),
        ("parallel_tool_calls", st.booleans(), json_values),
        *SYNTHETIC,
    ]
    return sometimes_odd(draw, fields, ("model", "input"))


def header_values() -> st.SearchStrategy[Any]:
    """Header values as the client sends them (bytes): odd characters, control
    characters, non-UTF-8 bytes, empty, huge."""
    return st.one_of(
        st.just(b""), st.binary(max_size=40),
        weird_text.map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.text(st.sampled_from("ab-é程序\x01\x7f\t /%"), max_size=10).map(str.encode),
        st.sampled_from([b"5b9c1f8e-0000-4000-8000-00000000c1a0", b"\xff\xfe", b"\x1b[31m",
                         b" ", b"\x00"]),
        st.integers(1_000, 100_000).map(lambda n: b"s" * n))


AGENT_HEADERS = ("X-Claude-Code-Session-Id", "session-id", "session_id", "conversation_id",
                 "thread-id", "x-codex-window-id", "X-Session-Id", "X-Program-Id",
                 "anthropic-version", "anthropic-beta", "x-api-key", "originator")
agent_headers = st.dictionaries(st.sampled_from(AGENT_HEADERS), header_values(), max_size=4)


# a query string (Claude Code adds ?beta=true; any is ignored)
queries = st.one_of(st.just(""), st.just("?beta=true"), st.text(st.sampled_from(
    "ab=&?%/#é+;"), max_size=12).map(lambda q: "?" + q))


@st.composite
def agent_request(draw: st.DrawFn, model: str) -> tuple[str, dict[str, Any]]:
    path = draw(st.sampled_from((MESSAGES, COUNT_TOKENS, RESPONSES)))
    body = (draw(responses_like(model)) if path == RESPONSES else
            draw(messages_like(model, count=path == COUNT_TOKENS)))
    return path + draw(queries), body


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_agent_api_bodies_never_5xx(target: Target, data: st.DataObject) -> None:
    path, body = data.draw(agent_request(target.model))
    target.send(path, json.dumps(body).encode(), data.draw(agent_headers))


@settings(FUZZ, max_examples=80)
@given(path=st.sampled_from(AGENT_PATHS), value=json_values, hdrs=agent_headers)
def test_agent_api_random_json_never_5xx(target: Target, path: str, value: Any,
                                         hdrs: dict[str, Any]) -> None:
    target.send(path, json.dumps(value).encode(), hdrs)


@settings(FUZZ, max_examples=80)
@given(path=st.sampled_from(AGENT_PATHS), raw=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda a, b, n: a * n + b * n, st.sampled_from([b"[", b"{\"a\":"]),
              st.sampled_from([b"]", b"}"]), st.integers(100, 3000)),
    st.integers(90, 6000).map(lambda n: b'{"model": "m", "messages": [], "max_tokens": '
                              + b"7" * n + b"}"),
    st.sampled_from([b"", b"null", b"{}", b"[]", b'"x"', b"{\"model\": NaN}",
                     b'{"model": "m", "input": "\\ud800"}', b"\xef\xbb\xbf{}"])),
    hdrs=agent_headers)
def test_agent_api_random_bytes_never_5xx(target: Target, path: str, raw: bytes,
                                          hdrs: dict[str, Any]) -> None:
    target.send(path, raw, hdrs)


@settings(FUZZ, max_examples=150)
@given(data=st.data(), name=st.sampled_from(AGENT_HEADERS), value=header_values())
def test_session_headers_on_good_bodies_never_5xx(target: Target, data: st.DataObject,
                                                  name: str, value: bytes) -> None:
    """A valid body of each API, one odd session header: the program is named (or
    anonymous), never refused for the client's own session ids."""
    path = data.draw(st.sampled_from((MESSAGES, RESPONSES, PATHS[0])))
    body: dict[str, Any] = {"model": target.model, "max_tokens": 2}
    if path == MESSAGES:
        body["messages"] = [{"role": "user", "content": "hi"}]
        body["metadata"] = {"user_id": json.dumps({"session_id": data.draw(session_ids)})}
    elif path == RESPONSES:
        body = {"model": target.model, "input": "hi", "max_output_tokens": 2,
                "prompt_cache_key": data.draw(st.one_of(st.none(), weird_text))}
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = target.send(path, json.dumps(body).encode(), {name: value})
    if name != "X-Program-Id" and r.text != HTTP_PARSER_REFUSAL:
        # a bad X-Program-Id is refused (it is the client's explicit id); nothing else is
        assert r.status_code == 200, (r.status_code, r.text[:300], path, name, value[:80])


def test_after_the_fuzz_the_gateway_serves_and_nothing_is_left_running(target: Target
                                                                        ) -> None:
    r = target.client.post(target.url + PATHS[0], json={
        "model": target.model, "messages": [{"role": "user", "content": "still there?"}],
        "max_tokens": 3, "program_id": "after-the-fuzz"})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["message"]["content"].split()) == 3
    r = target.client.post(target.url + MESSAGES + "?beta=true", json={
        "model": target.model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": json.dumps({"session_id": "after-the-fuzz"})}})
    assert r.status_code == 200 and r.json()["type"] == "message", r.text
    r = target.client.post(target.url + COUNT_TOKENS, json={
        "model": target.model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text
    r = target.client.post(target.url + RESPONSES, json={
        "model": target.model, "input": "hi", "max_output_tokens": 3,
        "prompt_cache_key": "after-the-fuzz"}, headers={"session-id": "after-the-fuzz"})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    progs = target.client.get(target.url + "/v1/programs").json()["data"]
    stuck = [p for p in progs if p["status"] == "reasoning" or p["in_flight"]]
    assert stuck == []
    assert not any(s >= 500 for s in target.statuses)
    for path, seen in target.by_path.items():  # some of the fuzz went through to the engine
        if sum(seen.values()) >= 50:
            assert seen.get(200, 0) > 0, (path, seen, target.refused_by_server)


@settings(FUZZ, max_examples=150)
@given(raw=st.one_of(st.binary(max_size=300),
                     json_values.map(lambda v: json.dumps(v).encode()),
                     st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"a":', b",", b"1",
                                               b"9" * 60, b'"\\ud800"', b"-", b".", b"e"]),
                              max_size=80).map(b"".join)))
def test_decode_body_raises_nothing_but_request_errors(raw: bytes) -> None:
    try:
        decode_body(raw)
    except RequestError as e:
        assert e.status == 400


def _nested(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


@settings(FUZZ, max_examples=200)
@given(depth=st.integers(0, MAX_JSON_DEPTH + 8),
       digits=st.integers(1, MAX_INT_DIGITS + 3),
       sign=st.sampled_from([1, -1]),
       pad=st.text(alphabet="[]{}0123456789 ab", max_size=40))
def test_bodies_passed_by_the_quick_check_are_within_the_limits(
        depth: int, digits: int, sign: int, pad: str) -> None:
    """The quick look at the raw bytes (``may_break_limits``) lets a body skip the walk
    over its tree only when the walk would find nothing: near the depth and the integer
    limits, with brackets and digits inside strings besides."""
    value = _nested(depth, [sign * int("9" * digits), pad])
    raw = json.dumps(value).encode()
    try:
        _check_tree(value)
    except RequestError:
        assert may_break_limits(raw)
