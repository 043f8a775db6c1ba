"""Bad input through ``mori serve`` with a simulated engine: every refusal is a 400 in
OpenAI's shape (never a 5xx), the program behind it is not registered, and the gateway
goes on serving. Program ids reach the engine intact (non-ASCII included), and anonymous
ids are the gateway's own (reserved prefix, unpredictable)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest
from gateway_harness import LoopThread, serve_on_simulated

from mori.cli.options import SERVE_BY_KEY
from mori.core.types import KVLabel
from mori.enginesim import EngineSimServer
from mori.gateway.app import Gateway
from mori.gateway.config import GatewaySettings
from mori.gateway.parsing import decode_body, parse_request
from mori.protocol.errors import RequestError
from mori.protocol.fields import (
    ANONYMOUS_PREFIX,
    anonymous_program_id,
    check_program_id,
    decode_program_id,
    encode_program_id,
)

CHAT = "/v1/chat/completions"


class Served:
    """One gateway in front of one simulated engine, served for the whole module."""

    def __init__(self, lt: LoopThread, url: str, gw: Gateway, engine: EngineSimServer,
                 model: str) -> None:
        self.lt, self.url, self.gw, self.engine, self.model = lt, url, gw, engine, model


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    lt = LoopThread()
    sim = serve_on_simulated(lt, GatewaySettings(time_scale=50.0, hold_timeout_s=30))
    model = httpx.get(sim.url + "/v1/models").json()["data"][0]["id"]
    try:
        yield Served(lt, sim.url, sim.gw, sim.engines[0], model)
    finally:
        lt.close()


def client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)


def chat_body(s: Served, **extra: Any) -> dict[str, Any]:
    return {"model": s.model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 2, **extra}


def programs(s: Served) -> list[dict[str, Any]]:
    r = httpx.get(s.url + "/v1/programs")
    assert r.status_code == 200
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def still_serves(s: Served, pid: str = "good-after") -> None:
    r = client(s).chat.completions.create(model=s.model, messages=[
        {"role": "user", "content": "again"}], max_tokens=3, extra_body={"program_id": pid})
    assert len((r.choices[0].message.content or "").split()) == 3


def assert_refused(s: Served, r: httpx.Response, needle: str, pid: str | None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]
    progs = programs(s)
    if pid is not None:
        assert pid not in {p["program_id"] for p in progs}
    assert not any(p["status"] == "reasoning" or p["in_flight"] for p in progs)
    still_serves(s)


def raw_body(s: Served, tail: str = "", max_tokens: int | None = 2) -> bytes:
    """A chat body written by hand, ``tail`` (JSON members, each led by a comma) added."""
    mt = "" if max_tokens is None else f', "max_tokens": {max_tokens}'
    head = f'{{"model": "{s.model}", "messages": [{{"role": "user", "content": "x"}}]{mt}'
    return (head + tail + "}").encode()


def post(s: Served, content: bytes, headers: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(s.url + CHAT, content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


# -- bad program ids in the body, sent by the official client --------------------------------

@pytest.mark.parametrize("pid,needle", [
    ("line\r\nbreak", "control characters (it has U+000D)"),
    ("nul\x00id", "control characters (it has U+0000)"),
    ("tab\tid", "control characters (it has U+0009)"),
    ("sep\u2028id", "control characters (it has U+2028)"),
    ("x" * 257, "at most 256 bytes"),
    ("é" * 129, "at most 256 bytes of UTF-8 (it has 258)"),
    ("anon-7", "reserved"),
    ("", "must not be empty"),
], ids=["crlf", "nul", "tab", "u2028", "257-bytes", "258-utf8-bytes", "anon-prefix", "empty"])
def test_a_bad_program_id_is_400_and_not_registered(served: Served, pid: str,
                                                    needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(served).chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"program_id": pid})
    assert e.value.status_code == 400
    body: Any = e.value.body
    assert needle in body["message"] and body["param"] == "program_id"
    assert_refused(served, e.value.response, needle, pid)


def test_a_huge_program_id_is_400(served: Served) -> None:
    pid = "p" * (4 * 1024 * 1024)
    r = post(served, raw_body(served, f', "program_id": "{pid}"'))
    assert_refused(served, r, "at most 256 bytes", pid)


def test_a_lone_surrogate_program_id_is_400(served: Served) -> None:
    raw = raw_body(served, ', "program_id": "lone-\\ud800"')
    assert_refused(served, post(served, raw), "surrogate", None)
    assert not any(p["program_id"].startswith("lone-") for p in programs(served))


# -- bad program ids in the header ------------------------------------------------------------

@pytest.mark.parametrize("value,needle", [
    (b"\xff\xfe-not-utf8", "must be UTF-8"),
    (b"\xc3", "must be UTF-8"),
    (b"anon-1", "reserved"),
    (b"x" * 300, "at most 256 bytes"),
    (b"c1\xc2\x85id", "control characters (it has U+0085)"),
], ids=["invalid-utf8", "truncated-utf8", "anon-prefix", "too-long", "c1-nel"])
def test_a_bad_program_id_header_is_400(served: Served, value: bytes, needle: str) -> None:
    r = post(served, raw_body(served), {"X-Program-Id": value})
    assert_refused(served, r, needle, None)
    assert r.json()["error"]["param"] == "program_id"


# -- bodies no JSON parser should choke on ----------------------------------------------------

def test_json_nested_100000_deep_is_400(served: Served) -> None:
    raw = raw_body(served, ', "program_id": "deep-prog", "x": '
                   + "[" * 100_000 + "]" * 100_000)
    assert_refused(served, post(served, raw), "nested too deeply", "deep-prog")


def test_json_nested_past_the_limit_is_400_and_within_it_is_served(served: Served) -> None:
    def body(depth: int, pid: str) -> bytes:
        return raw_body(served, f', "program_id": "{pid}", "x": ' + "[" * depth + "]" * depth)
    assert_refused(served, post(served, body(500, "nest-500")), "at most 128 levels",
                   "nest-500")
    r = post(served, body(100, "nest-100"))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("digits", [5000, 101])
def test_a_long_integer_literal_is_400(served: Served, digits: int) -> None:
    pid = f"int-{digits}"
    raw = raw_body(served, f', "program_id": "{pid}", "max_tokens": ' + "9" * digits,
                   max_tokens=None)
    assert_refused(served, post(served, raw), "100 digits", pid)


def test_long_digit_strings_and_floats_are_fine(served: Served) -> None:
    r = client(served).chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "7" * 5000}], max_tokens=2,
        temperature=0.5, extra_body={"program_id": "digits-in-text"})
    assert r.choices[0].message.content


@pytest.mark.parametrize("extra,needle", [
    ({"mori": {"prompt_tokens": 10 ** 30}}, "does not fit"),
    ({"mori": {"prompt_tokens": -1}}, "mori.prompt_tokens"),
    ({"mori": "x"}, "'mori'"),
    ({"mori": {"prompt_tokens": 10, "reuse_tokens": 20}}, "exceeds"),
    ({"max_tokens": 10 ** 30}, "maximum context length"),  # the engine's refusal
    ({"stream": "yes"}, "'stream'"),
    ({"stream": 1}, "'stream'"),
    ({"max_tokens": True}, "max_tokens"),
])
def test_other_fields_out_of_range_are_4xx(served: Served, extra: dict[str, Any],
                                           needle: str) -> None:
    r = httpx.post(served.url + CHAT, json=chat_body(served, program_id="fields", **extra),
                   timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert not any(p["status"] == "reasoning" or p["in_flight"] for p in programs(served))
    still_serves(served)


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"NaN", b'{"a": 1e999}', b"[" * 50,
                                 b'{"model": "m", "messages": [{"role": "user"}]}\x00'])
def test_garbage_bodies_are_400(served: Served, raw: bytes) -> None:
    r = post(served, raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


# -- ids reach the engine intact ----------------------------------------------------------------

@pytest.mark.parametrize("how", ["body", "header"])
def test_a_non_ascii_id_reaches_the_engine_and_its_kv_controls(served: Served,
                                                               how: str) -> None:
    pid = f"程序-é-{how} /%?#"
    # a prompt of a few pages: the engine keeps a request's whole pages only
    long = {"messages": [{"role": "user", "content": "hello " * 100}]}
    if how == "body":
        r = httpx.post(served.url + CHAT, json=chat_body(served, program_id=pid, **long),
                       timeout=30)
    else:
        r = httpx.post(served.url + CHAT, json=chat_body(served, **long), timeout=30,
                       headers={"X-Program-Id": pid.encode()})
    assert r.status_code == 200, r.text
    assert pid in {p["program_id"] for p in programs(served)}
    engine = served.engine.engine
    # the engine names the program by the same id: its KV, and the label the policy set
    assert pid in engine.pools.entries
    assert pid.encode().decode("latin-1") not in engine.pools.entries  # not mis-decoded
    assert quote(pid, safe="") not in engine.pools.entries  # nor left encoded
    res = httpx.get(served.url + "/v1/residency").json()["data"][0]
    assert res["engine_gpu_tokens"].get(pid, 0) > 0
    # a KV control by program id reaches it: the label, then the offload
    adapter = served.gw.adapters[0]
    served.lt.call(adapter.set_label(pid, KVLabel.INACTIVE))
    assert engine.pools.entries[pid].label is KVLabel.INACTIVE
    served.lt.call(adapter.offload(pid))
    assert engine.program_state(pid)["cpu_tokens"] > 0
    # and the gateway's own per-program endpoints take it percent-encoded
    r = httpx.get(f"{served.url}/v1/programs/{quote(pid, safe='')}")
    assert r.status_code == 200 and r.json()["program_id"] == pid
    r = httpx.post(f"{served.url}/v1/programs/{quote(pid, safe='')}/release")
    assert r.status_code == 200, r.text
    assert pid not in {p["program_id"] for p in programs(served)}


# -- anonymous ids --------------------------------------------------------------------------

def test_anonymous_ids_are_reserved_and_unpredictable(served: Served) -> None:
    for _ in range(3):
        r = httpx.post(served.url + CHAT, json=chat_body(served), timeout=30)
        assert r.status_code == 200, r.text
    log = httpx.get(served.url + "/v1/decisions").json()["data"]
    anon = {d["program_id"] for d in log if d["program_id"].startswith("anon-")}
    assert len(anon) == 3
    assert all(re.fullmatch(r"anon-[0-9a-f]{32}", a) for a in anon)
    # none of them can be named by a client
    for a in anon:
        r = httpx.post(served.url + CHAT, json=chat_body(served, program_id=a), timeout=30)
        assert r.status_code == 400 and "reserved" in r.json()["error"]["message"]
    assert not any(p["program_id"].startswith("anon-") for p in programs(served))


# -- the rules, unit by unit ----------------------------------------------------------------

def test_the_program_id_rules_and_the_configurable_limit() -> None:
    body = raw_body_for("m", ', "program_id": "程序"')  # 6 bytes of UTF-8
    assert parse_request(CHAT, body, None, 6).program_id == "程序"
    with pytest.raises(RequestError, match="at most 5 bytes of UTF-8 .it has 6"):
        parse_request(CHAT, body, None, 5)
    # the header: its bytes (latin-1 decoded by Starlette) are UTF-8; the body wins
    header = "程序-é".encode().decode("latin-1")
    assert parse_request(CHAT, raw_body_for("m"), header).program_id == "程序-é"
    assert parse_request(CHAT, raw_body_for("m"), "程序-é".encode()).program_id == "程序-é"
    with pytest.raises(RequestError, match="must be UTF-8"):
        parse_request(CHAT, raw_body_for("m"), b"\xff")
    assert parse_request(CHAT, body, header).program_id == "程序"
    with pytest.raises(RequestError, match="reserved"):  # both are validated
        parse_request(CHAT, body, "anon-x")
    assert check_program_id("anon-x", reserved_ok=True) == "anon-x"
    for bad in (None, 7, "", "a\x1fb", "a\x9fb", "a\u2029b", "\ud800"):
        with pytest.raises(RequestError) as e:
            check_program_id(bad)
        assert e.value.status == 400 and e.value.param == "program_id"
    # anonymous ids: the reserved prefix, 128 random bits
    a, b = anonymous_program_id(), anonymous_program_id()
    assert a != b and a.startswith(ANONYMOUS_PREFIX) and len(a) == len("anon-") + 32
    # the engine header form: ASCII, and back
    odd = '程序-é "q" /%41\u00a0✓'
    assert encode_program_id(odd).isascii() and decode_program_id(encode_program_id(odd)) == odd
    with pytest.raises(RequestError):
        decode_program_id("%ff")
    # the setting and its flag
    assert GatewaySettings().max_program_id_bytes == 256
    for n in (0, 1025):
        with pytest.raises(ValueError, match="max_program_id_bytes"):
            GatewaySettings(max_program_id_bytes=n)
    assert SERVE_BY_KEY["max_program_id_bytes"].flag == "--max-program-id-bytes"


def raw_body_for(model: str, tail: str = "") -> bytes:
    return (f'{{"model": "{model}", "messages": [{{"role": "user", "content": "x"}}]'
            + tail + "}").encode()


@pytest.mark.parametrize("raw", [
    b"[" * 100_000, b"{" * 100_000, b'{"a":' * 50_000, b"[" * 100_000 + b"]" * 100_000,
    b"1" * 5000, b"-" + b"1" * 5000, b"[" + b"1" * 101 + b"]", b'"\\ud800"', b"\xed\xa0\x80",
    b"1e99999", b"-Infinity", b"\x00", b"",
])
def test_decode_body_raises_only_request_errors(raw: bytes) -> None:
    with pytest.raises(RequestError) as e:
        decode_body(raw)
    assert e.value.status == 400
