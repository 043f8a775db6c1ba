"""Bad input and engine faults: clear errors, nothing else disturbed, no program stuck."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from gateway_harness import FakeEngine, LoopThread, Running

from mori.engines.http import OpenAIHTTPAdapter
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings

MSG = [{"role": "user", "content": "hello " * 40}]


def start(lt: LoopThread, fake: FakeEngine, kv_tokens: int = 100_000, timeout_s: float = 30.0,
          **settings: Any) -> tuple[Running, Running]:
    eng = lt.serve(fake.app())
    adapter = OpenAIHTTPAdapter(eng.url, kv_tokens=kv_tokens, page_tokens=16,
                                timeout_s=timeout_s, connect_timeout_s=1.0)
    settings.setdefault("health_interval_s", 0.1)
    gw = lt.serve(create_app(GatewaySettings(**settings), [adapter]))
    return eng, gw


def client(gw: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=30)


def program(gw: Running, pid: str) -> dict[str, Any]:
    r = httpx.get(f"{gw.url}/v1/programs/{pid}")
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def ok_request(gw: Running, pid: str = "after") -> None:
    r = client(gw).chat.completions.create(model="fake-model", messages=MSG, max_tokens=3,
                                           extra_body={"program_id": pid})
    assert r.choices[0].message.content == "w w w "


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "'model'"),
    (b'{"model": "fake-model", "messages": "hi"}', 400, "'messages'"),
    (b'{"model": "fake-model", "messages": [{"content": "x"}]}', 400, "role"),
    (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
     400, "'stream'"),
    (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
     400, "max_tokens"),
    (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "program_id": 7}',
     400, "program_id"),
    (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], '
     b'"mori": {"prompt_tokens": "many"}}', 400, "mori.prompt_tokens"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "does not exist"),
])
def test_bad_requests_get_openai_errors(loop_thread: LoopThread, body: bytes, status: int,
                                        needle: str) -> None:
    fake = FakeEngine()
    _, gw = start(loop_thread, fake)
    r = httpx.post(gw.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error"
    assert fake.requests == []  # nothing reached the engine
    ok_request(gw)  # and the gateway still serves


def test_oversized_body_is_413(loop_thread: LoopThread) -> None:
    fake = FakeEngine()
    _, gw = start(loop_thread, fake, max_body_bytes=4096)
    big = [{"role": "user", "content": "x" * 10_000}]
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model="fake-model", messages=big,
                                           extra_body={"program_id": "big"})
    assert e.value.status_code == 413
    assert "exceeds" in str(e.value)
    ok_request(gw)


def test_prompt_larger_than_a_replica_is_refused(loop_thread: LoopThread) -> None:
    _, gw = start(loop_thread, FakeEngine(), kv_tokens=48)
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).chat.completions.create(model="fake-model", messages=MSG,
                                           extra_body={"program_id": "huge"})
    assert "does not fit" in str(e.value)


def test_client_error_from_openai_client_is_clear(loop_thread: LoopThread) -> None:
    _, gw = start(loop_thread, FakeEngine())
    with pytest.raises(openai.NotFoundError) as e:
        client(gw).chat.completions.create(model="other", messages=MSG)
    assert "fake-model" in str(e.value)  # says what is served


def test_engine_refusing_connections_gives_503_and_recovers(loop_thread: LoopThread) -> None:
    fake = FakeEngine()
    eng, gw = start(loop_thread, fake)
    port = int(eng.url.rsplit(":", 1)[1])
    ok_request(gw, "p")
    loop_thread.call(eng.stop())
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model="fake-model", messages=MSG,
                                           extra_body={"program_id": "p"})
    assert e.value.status_code == 503
    # the forward was refused, or the health probe had already found the engine gone
    assert "the engine refused the connection" in str(e.value) or \
        "every engine replica is unhealthy" in str(e.value)
    assert eng.url not in str(e.value) and str(port) not in str(e.value)  # no address
    assert program(gw, "p")["status"] == "acting"  # not stuck reasoning
    health = httpx.get(gw.url + "/healthz")
    assert health.status_code == 503 and health.json()["replicas"][0]["healthy"] is False
    loop_thread.serve(fake.app(), port=port)  # the engine comes back
    wait_for(lambda: httpx.get(gw.url + "/healthz").status_code == 200)
    ok_request(gw, "p")
    # two answered steps, and the refused one if it reached the engine before the probe
    # found it gone (then it ended as a step too)
    assert program(gw, "p")["steps"] in (2, 3)


def test_engine_timeout_gives_504(loop_thread: LoopThread) -> None:
    fake = FakeEngine(mode="hang")
    _, gw = start(loop_thread, fake, timeout_s=0.5)
    with pytest.raises(openai.APIStatusError) as e:
        client(gw).chat.completions.create(model="fake-model", messages=MSG,
                                           extra_body={"program_id": "slow"})
    assert e.value.status_code == 504
    assert program(gw, "slow")["status"] == "acting"


def test_engine_error_status_is_passed_through(loop_thread: LoopThread) -> None:
    fake = FakeEngine(mode="error500")
    _, gw = start(loop_thread, fake)
    with pytest.raises(openai.InternalServerError) as e:
        client(gw).chat.completions.create(model="fake-model", messages=MSG,
                                           extra_body={"program_id": "e"})
    assert "boom" in str(e.value)
    assert program(gw, "e")["status"] == "acting"


def test_engine_dying_mid_stream_sends_an_error_event(loop_thread: LoopThread) -> None:
    fake = FakeEngine(mode="die", die_after=2)
    _, gw = start(loop_thread, fake)
    got: list[str] = []
    with pytest.raises(openai.APIError) as e:
        stream = client(gw).chat.completions.create(
            model="fake-model", messages=MSG, max_tokens=10, stream=True,
            extra_body={"program_id": "dies"})
        for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
    assert "the engine died mid-stream" in str(e.value)
    assert "127.0.0.1" not in str(e.value)
    assert got == ["w ", "w "]  # the chunks before the failure were passed through
    assert program(gw, "dies")["status"] == "acting"
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'mori_upstream_errors_total{replica="0"} 1.0' in metrics


def test_client_leaving_mid_stream_cancels_upstream(loop_thread: LoopThread) -> None:
    fake = FakeEngine(token_delay_s=0.05)
    _, gw = start(loop_thread, fake)
    body = {"model": "fake-model", "messages": MSG, "max_tokens": 200, "stream": True,
            "program_id": "leaver"}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    wait_for(lambda: fake.cancelled == 1)
    wait_for(lambda: program(gw, "leaver")["status"] == "acting")
    assert fake.active == 0
    assert "mori_client_disconnects_total 1.0" in httpx.get(gw.url + "/metrics").text


def test_held_request_times_out_with_retry_after_and_queue_is_bounded(
        loop_thread: LoopThread) -> None:
    fake = FakeEngine(token_delay_s=0.02)
    # 3 programs of ~300 tokens; the GPU holds one at a time
    _, gw = start(loop_thread, fake, kv_tokens=400, hold_timeout_s=0.3, max_held=1,
                  retry_after_s=2)
    body_a = {"model": "fake-model", "max_tokens": 100, "stream": True, "program_id": "a",
              "messages": [{"role": "user", "content": "x" * 1100}]}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body_a) as ra:
        lines_a = ra.iter_lines()
        next(lines_a)  # a is running on the GPU
        body_b = dict(body_a, program_id="b", stream=False)
        rb = httpx.post(gw.url + "/v1/chat/completions", json=body_b)
        assert rb.status_code == 503
        assert rb.headers["retry-after"] == "2"
        assert "waited" in rb.json()["error"]["message"]
        assert program(gw, "b")["status"] == "held"  # still held for a retry
        rc = httpx.post(gw.url + "/v1/chat/completions", json=dict(body_b, program_id="c"))
        assert rc.status_code == 429
        assert rc.headers["retry-after"] == "2"
        for _ in lines_a:
            pass
    # a finished: b's held request is forwarded with nobody waiting; its step ends at once
    wait_for(lambda: program(gw, "b")["status"] == "acting")
    rb2 = httpx.post(gw.url + "/v1/chat/completions", json=dict(body_b, max_tokens=2))
    assert rb2.status_code == 200
    assert program(gw, "b")["steps"] == 2
