"""Every error answer is JSON in its API's shape (OpenAI's ``{"error": {...}}``;
Anthropic's ``{"type": "error", ...}`` under ``/v1/messages``): unknown paths, wrong
methods and failing handlers included. A client's value quoted in an error (a model name,
a program id) is cut to ``ECHO_LIMIT`` characters. A stalled stream's cut-off ends its
response as a client gone (uvicorn logs no unfinished response); a stream the engine cuts
off ends with an error event even where the engine's body has no framing (it ends at
EOF); and ``/healthz`` drops a replica's last error once it is healthy again. The shapes
and the cut echoes hold alike where a worker process serves the connection
(``--workers 2``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from gateway_harness import FakeEngine, LoopThread, Running, SimGateway, serve_on_simulated
from through_workers import VIA, WorkersGateway, workers_config

import mori.gateway.endpoint as endpoint_mod
import mori.gateway.proxy as proxy_mod
from mori.engines.http import OpenAIHTTPAdapter
from mori.enginesim import EngineSimConfig, start_engine_sim
from mori.gateway.answers import ChatWatcher
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.control import Controller
from mori.protocol.errors import ECHO_LIMIT

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def lt() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def sim(lt: LoopThread) -> SimGateway:
    return serve_on_simulated(lt, GatewaySettings(time_scale=50.0))


@pytest.fixture(scope="module", params=VIA)
def served(request: pytest.FixtureRequest, lt: LoopThread, sim: SimGateway) -> Iterator[str]:
    """The gateway's URL, its connections served by the policy process or by a worker."""
    if request.param == "policy":
        yield sim.url
        return
    g = WorkersGateway(lt, workers_config(settings=GatewaySettings(time_scale=50.0),
                                          preset="h200-qwen3-30b-a3b"))
    try:
        yield g.url
    finally:
        g.close()


def openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert "type" not in body and set(body["error"]) >= {"message", "type", "code"}, body
    if code is not None:
        assert body["error"]["code"] == code, body
    err: dict[str, Any] = body["error"]
    return err


def anthropic_error(r: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    err: dict[str, Any] = body["error"]
    return err


# -- (a) every error is JSON in its API's shape ----------------------------------------------

def test_unknown_paths_and_wrong_methods_are_json(served: str) -> None:
    u = served
    assert "/nope" in openai_error(httpx.get(u + "/nope"), 404, "not_found")["message"]
    openai_error(httpx.post(u + "/v1/chat/completion"), 404, "not_found")
    err = openai_error(httpx.get(u + CHAT), 405, "method_not_allowed")
    assert "GET" in err["message"]
    assert httpx.get(u + CHAT).headers["allow"] == "POST"
    openai_error(httpx.put(u + "/v1/models"), 405, "method_not_allowed")
    openai_error(httpx.delete(u + "/v1/programs/x"), 405, "method_not_allowed")
    openai_error(httpx.get(u + "/v1/responses"), 405)
    anthropic_error(httpx.get(u + "/v1/messages"), 405, "invalid_request_error")
    anthropic_error(httpx.post(u + "/v1/messages/batches", json={}), 404, "not_found_error")
    anthropic_error(httpx.get(u + "/v1/messages/count_tokens"), 405,
                    "invalid_request_error")


def test_a_failing_handler_answers_json_500(sim: SimGateway,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(Controller, "describe_page", boom)
    err = openai_error(httpx.get(sim.url + "/v1/programs"), 500, "internal_error")
    assert "a bug" not in err["message"]
    # the completion paths (served before Starlette's routing) too, in their shapes
    monkeypatch.setattr(endpoint_mod, "parse_request", boom)
    openai_error(httpx.post(sim.url + CHAT, json={}), 500, "internal_error")
    anthropic_error(httpx.post(sim.url + "/v1/messages", json={}), 500, "api_error")
    monkeypatch.undo()
    assert httpx.get(sim.url + "/v1/programs").status_code == 200  # serving on


def test_the_engine_sims_errors_are_json(lt: LoopThread) -> None:
    srv = lt.call(start_engine_sim(EngineSimConfig("h200-qwen3-30b-a3b")))
    lt.handles.append(srv)
    openai_error(httpx.get(srv.url + "/nope"), 404, "not_found")
    openai_error(httpx.get(srv.url + CHAT), 405, "method_not_allowed")
    anthropic_error(httpx.get(srv.url + "/v1/messages"), 405, "invalid_request_error")


# -- (b) echoed values are cut --------------------------------------------------------------

def test_a_huge_model_name_is_not_echoed_whole(served: str, lt: LoopThread) -> None:
    name = "m" * 1_000_000
    r = httpx.post(served + CHAT, json={"model": name, "messages": MSG}, timeout=60)
    err = openai_error(r, 404, "model_not_found")
    assert len(err["message"]) < ECHO_LIMIT + 500
    assert "(1000000 characters)" in err["message"]
    r = httpx.post(served + "/v1/messages", json={"model": name, "messages": MSG,
                                                 "max_tokens": 2}, timeout=60)
    assert len(anthropic_error(r, 404, "not_found_error")["message"]) < ECHO_LIMIT + 500
    # the engine, asked directly, cuts it too
    srv = lt.call(start_engine_sim(EngineSimConfig("h200-qwen3-30b-a3b")))
    lt.handles.append(srv)
    r = httpx.post(srv.url + CHAT, json={"model": name, "messages": MSG}, timeout=60)
    err = openai_error(r, 404, "model_not_found")
    assert len(err["message"]) < ECHO_LIMIT + 200 and "1000000 characters" in err["message"]
    pid = "p" * 20_000
    err = openai_error(httpx.get(f"{served}/v1/programs/{pid}"), 404, "program_not_found")
    assert len(err["message"]) < ECHO_LIMIT + 200


# -- (c) a stalled stream's cut-off leaves no "returned without completing" -----------------

def test_a_stalled_streams_cut_off_is_a_clean_end(lt: LoopThread,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    settings = GatewaySettings(time_scale=100.0, stream_write_timeout_s=1.0)
    g = serve_on_simulated(lt, settings)
    model = g.gw.models[0]["id"]
    body = json.dumps({"model": model, "messages": MSG, "stream": True,
                       "max_tokens": 100_000, "program_id": "stall",
                       "mori": {"prompt_tokens": 100}}).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = g.url.removeprefix("http://").split(":")
    s.connect((host, int(port)))
    s.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: " + host.encode()
              + b"\r\ncontent-type: application/json\r\ncontent-length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    try:
        wait_for(lambda: "mori_stream_timeouts_total 1.0" in metrics(g.url),
                 "the stream was cut off")
        time.sleep(0.5)  # the server's own handling of the response's end
        logged = [r.getMessage() for r in caplog.records]
        assert not [m for m in logged if "without completing response" in m], logged
        assert any("stream cut off" in m for m in logged)  # the gateway's own warning
        # the connection is closed: what the client reads ends (a timeout fails)
        s.settimeout(10)
        try:
            while s.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
    finally:
        s.close()


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=30).text


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not reached in {timeout:g} s: {what}")
        time.sleep(0.05)


# -- (d) /healthz: no stale last error ------------------------------------------------------

def test_healthz_clears_the_last_error_on_recovery(lt: LoopThread) -> None:
    fake = FakeEngine()
    eng = lt.serve(fake.app())
    port = int(eng.url.rsplit(":", 1)[1])
    adapter = OpenAIHTTPAdapter(eng.url, kv_tokens=100_000, connect_timeout_s=1.0)
    gw = lt.serve(create_app(GatewaySettings(health_interval_s=0.1), [adapter]))
    body = {"model": "fake-model", "messages": MSG, "max_tokens": 2, "program_id": "p"}
    lt.call(eng.stop())
    with contextlib.suppress(httpx.TimeoutException):  # refused (503), or held meanwhile
        httpx.post(gw.url + CHAT, json=body, timeout=3)
    wait_for(lambda: httpx.get(gw.url + "/healthz").status_code == 503, "unhealthy")
    row = httpx.get(gw.url + "/healthz").json()["replicas"][0]
    assert row["healthy"] is False and row["last_error"]
    lt.serve(fake.app(), port=port)  # the engine comes back
    wait_for(lambda: httpx.get(gw.url + "/healthz").status_code == 200, "healthy again")
    row = httpx.get(gw.url + "/healthz").json()["replicas"][0]
    assert row["healthy"] is True and row["last_error"] is None
    r = httpx.post(gw.url + CHAT, json=dict(body, program_id="q"), timeout=30)
    assert r.status_code == 200, r.text


# -- (e) a stream cut off by the engine ends with an error event ------------------------------

OPENAI_HEAD = b"".join(b"data: " + json.dumps(
    {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
     "choices": [{"index": 0, "delta": {"content": "w "}, "finish_reason": None}]}
).encode() + b"\n\n" for _ in range(2))
ANTHROPIC_HEAD = (
    b'event: message_start\ndata: {"type": "message_start", "message": {"id": "m", '
    b'"type": "message", "role": "assistant", "content": [], "model": "m", '
    b'"usage": {"input_tokens": 3, "output_tokens": 0}}}\n\n'
    b'event: content_block_start\ndata: {"type": "content_block_start", "index": 0, '
    b'"content_block": {"type": "text", "text": ""}}\n\n'
    b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
    b'"delta": {"type": "text_delta", "text": "w "}}\n\n')
RESPONSES_HEAD = (  # its objects carry "error": null; not an error event
    b'event: response.created\ndata: {"type": "response.created", "response": {"id": '
    b'"r", "object": "response", "status": "in_progress", "error": null, "output": []}}'
    b'\n\nevent: response.output_text.delta\ndata: {"type": '
    b'"response.output_text.delta", "delta": "w "}\n\n')
ENDS = {"/v1/responses": b'event: response.completed\ndata: {"type": "response.completed", '
                         b'"response": {"id": "r", "status": "completed", "error": null, '
                         b'"output": []}}\n\n',
        CHAT: b"data: [DONE]\n\n",
        "/v1/messages": b'event: content_block_stop\ndata: {"type": "content_block_stop", '
                        b'"index": 0}\n\nevent: message_stop\ndata: {"type": '
                        b'"message_stop"}\n\n'}


async def eof_engine(stream: bytes) -> asyncio.Server:
    """An engine whose streams have no framing (no length, not chunked: they end when it
    closes the connection), sending ``stream`` to any POST; 404 to anything else."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        await reader.readexactly(int(m.group(1)) if m else 0)
        if head.startswith(b"POST"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\n\r\n" + stream)
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n"
                         b"connection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def gateway_before(lt: LoopThread, stream: bytes) -> Running:
    server = lt.call(eof_engine(stream))

    async def close() -> None:
        server.close()

    class Handle:
        async def stop(self) -> None:
            await close()

    lt.handles.append(Handle())
    port = server.sockets[0].getsockname()[1]
    adapter = OpenAIHTTPAdapter(f"http://127.0.0.1:{port}", kv_tokens=100_000)
    return lt.serve(create_app(GatewaySettings(), [adapter]))


def streamed(gw: Running, path: str) -> str:
    body: dict[str, Any] = {"model": "m", "messages": MSG, "input": "hi", "max_tokens": 5,
                            "stream": True}
    with httpx.stream("POST", gw.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200
        return r.read().decode()


@pytest.mark.parametrize("path,head", [(CHAT, OPENAI_HEAD), ("/v1/messages", ANTHROPIC_HEAD),
                                       ("/v1/responses", RESPONSES_HEAD)],
                         ids=["chat", "messages", "responses"])
def test_a_stream_cut_off_at_eof_ends_with_an_error_event(lt: LoopThread, path: str,
                                                          head: bytes) -> None:
    text = streamed(gateway_before(lt, head), path)
    assert text.startswith(head.decode())  # what came is passed on
    tail = text[len(head):]
    if path == CHAT:
        assert tail.startswith("data: {\"error\": ") and tail.endswith("data: [DONE]\n\n")
        err = json.loads(tail.split("\n\n")[0].removeprefix("data: "))["error"]
    else:
        assert tail.startswith("event: error\ndata: ")
        err = json.loads(tail.split("\n", 1)[1].removeprefix("data: "))
        err = err["error"] if path == "/v1/messages" else err  # Responses: flat
    assert "ended its stream before its answer" in err["message"]
    assert "127.0.0.1" not in err["message"]  # the engine's address stays in the log
    # a complete stream is passed on as it is
    whole = head + ENDS[path]
    assert streamed(gateway_before(lt, whole), path) == whole.decode()


def test_a_relay_fault_still_ends_the_stream_with_an_error(
        lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(ChatWatcher):
        def rest(self) -> bytes:  # after the stream's lines were passed on
            raise RuntimeError("a bug")

    monkeypatch.setattr(proxy_mod, "watcher_for", lambda spec, max_line: Broken(max_line))
    text = streamed(gateway_before(lt, OPENAI_HEAD + ENDS[CHAT]), CHAT)
    assert text.startswith(OPENAI_HEAD.decode())
    assert "the gateway failed mid-stream" in text and text.endswith("data: [DONE]\n\n")


def test_a_relay_fault_before_any_byte_is_a_502(
        lt: LoopThread, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(ChatWatcher):
        def feed(self, chunk: bytes) -> bytes:
            raise RuntimeError("a bug")

    monkeypatch.setattr(proxy_mod, "watcher_for", lambda spec, max_line: Broken(max_line))
    gw = gateway_before(lt, OPENAI_HEAD + ENDS[CHAT])
    r = httpx.post(gw.url + CHAT, json={"model": "m", "messages": MSG, "stream": True},
                   timeout=30)
    assert r.status_code == 502
    assert r.json()["error"]["message"] == "the gateway failed mid-stream"
