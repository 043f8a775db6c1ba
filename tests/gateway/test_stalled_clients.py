"""Slow and stalled clients hold neither programs nor engine work: a stream whose client
stops reading is cut off after ``stream_write_timeout_s`` (its engine request aborted, the
program Acting again); a client that leaves while its request is held never has it run,
and one that leaves while its request runs has it aborted. Real servers (uvicorn) and
raw sockets, so the flow control and the disconnects are the real ones."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from gateway_harness import LoopThread, Running

from mori.cli.main import build_parser
from mori.cli.serve_cmd import ServeUsageError, build_config
from mori.engines.base import EngineAdapter
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig, start_simulated_backends

CHAT = "/v1/chat/completions"


def start(lt: LoopThread, settings: GatewaySettings, gpu_kv_tokens: int | None = None
          ) -> tuple[Running, EngineAdapter, str]:
    cfg = ServeConfig(replicas=1, gpu_kv_tokens=gpu_kv_tokens, settings=settings)
    adapters, handles = lt.call(start_simulated_backends(cfg))
    lt.handles.extend(handles)
    gw = lt.serve(create_app(settings, adapters))
    model = httpx.get(gw.url + "/v1/models").json()["data"][0]["id"]
    return gw, adapters[0], model


def metric(where: str | EngineAdapter, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples at ``where``'s /metrics (a URL, or an embedded engine's
    adapter, whose token it sends) whose labels include ``labels``."""
    url, token = ((where, None) if isinstance(where, str)
                  else (where.url, getattr(where, "token", None)))
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    total = 0.0
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        if not (line.startswith(name + " ") or line.startswith(name + "{")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def program(gw: Running, pid: str) -> dict[str, Any] | None:
    r = httpx.get(f"{gw.url}/v1/programs/{pid}", timeout=30)
    return r.json() if r.status_code == 200 else None


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` (generous deadline: the machine may be loaded)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not reached in {timeout:g} s: {what}")
        time.sleep(0.05)


def status(gw: Running, pid: str) -> tuple[str, bool] | None:
    p = program(gw, pid)
    return None if p is None else (p["status"], p["in_flight"])


def raw_request(gw: Running, body: dict[str, Any], rcvbuf: int | None = None) -> socket.socket:
    """Send a completion request on a raw socket and return it, unread."""
    data = json.dumps(body).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # a small window: the server's buffers fill sooner
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((gw.host, gw.port))
    s.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: 127.0.0.1\r\n"
              b"content-type: application/json\r\ncontent-length: "
              + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def chat(model: str, pid: str, prompt: int, out: int, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "go"}], "stream": stream,
            "max_tokens": out, "program_id": pid, "mori": {"prompt_tokens": prompt}}


def test_a_stream_nobody_reads_is_cut_off_and_its_program_freed(loop_thread: LoopThread
                                                                 ) -> None:
    # 100 simulated s per wall s: ~20k tokens (~4 MB of SSE) per wall second, 100k in all;
    # the socket buffers hold a small part of it
    settings = GatewaySettings(time_scale=100.0, stream_write_timeout_s=1.0)
    gw, engine, model = start(loop_thread, settings, gpu_kv_tokens=200_000)
    sock = raw_request(gw, chat(model, "stall", 100, 100_000, stream=True), rcvbuf=4096)
    try:
        wait_for(lambda: status(gw, "stall") == ("reasoning", True), "the stream runs")
        wait_for(lambda: status(gw, "stall") == ("acting", False),
                 "the stalled stream's program is Acting again")
        assert metric(gw.url, "mori_stream_timeouts_total") == 1
        assert metric(gw.url, "mori_client_disconnects_total") == 1
        wait_for(lambda: metric(engine, "mori_engine_requests_aborted_total") == 1,
                 "the engine aborted the request")
        assert metric(engine, "mori_engine_requests_finished_total") == 0
        # a retry of the same program is accepted (no 409) and served
        r = httpx.post(gw.url + CHAT, json=chat(model, "stall", 100, 3), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert status(gw, "stall") == ("acting", False)
    finally:
        sock.close()


def test_a_client_that_leaves_while_held_never_reaches_the_engine(loop_thread: LoopThread
                                                                  ) -> None:
    # one replica with room for one of the two programs: "long" runs (~230 tokens per
    # wall second, 8000 to go), "held" waits for GPU residency
    settings = GatewaySettings(time_scale=1.0)
    gw, engine, model = start(loop_thread, settings, gpu_kv_tokens=32_768)
    long = raw_request(gw, chat(model, "long", 20_000, 8_000))
    sent = time.monotonic()
    held = raw_request(gw, chat(model, "held", 20_000, 8))
    try:
        wait_for(lambda: status(gw, "long") == ("reasoning", True), "the first request runs")
        wait_for(lambda: status(gw, "held") == ("held", False), "the second is held")
        assert metric(engine, "mori_engine_requests_total") == 1
        # the gauge of the longest wait counts the held request's wait as it grows
        first = metric(gw.url, "mori_held_oldest_seconds")
        time.sleep(0.3)
        second = metric(gw.url, "mori_held_oldest_seconds")
        assert first > 0 and first + 0.25 <= second <= time.monotonic() - sent

        held.close()  # the client leaves while its request is held
        wait_for(lambda: metric(gw.url, "mori_requests_total", status="499") == 1,
                 "the gateway noticed the client leave")
        assert status(gw, "held") == ("held", False)  # held for a retry, not forwarded

        long.close()  # the client leaves while its request runs: the engine aborts it
        wait_for(lambda: metric(engine, "mori_engine_requests_aborted_total") == 1,
                 "the engine aborted the running request")
        wait_for(lambda: status(gw, "long") == ("acting", False), "the first program is freed")
        assert metric(gw.url, "mori_requests_total", status="499") == 2

        # the held request is forwarded once there is room; nobody waits for it, so it
        # ends at once without reaching the engine
        assert httpx.post(f"{gw.url}/v1/programs/long/release").status_code == 200
        wait_for(lambda: status(gw, "held") == ("acting", False),
                 "the abandoned request ended without running")
        assert metric(engine, "mori_engine_requests_total") == 1
        assert metric(engine, "mori_engine_requests_finished_total") == 0

        r = httpx.post(gw.url + CHAT, json=chat(model, "held", 20_000, 3), timeout=60)
        assert r.status_code == 200, r.text
        assert metric(engine, "mori_engine_requests_total") == 2
        assert metric(gw.url, "mori_held_oldest_seconds") == 0  # none is held
    finally:
        long.close()
        held.close()


def test_stream_write_timeout_setting() -> None:
    assert GatewaySettings().stream_write_timeout_s == 30.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="stream_write_timeout_s"):
            GatewaySettings(stream_write_timeout_s=bad)
    args = build_parser().parse_args(["serve", "--stream-write-timeout", "2.5"])
    assert build_config(args).settings.stream_write_timeout_s == 2.5
    with pytest.raises(ServeUsageError, match="stream_write_timeout_s"):
        build_config(build_parser().parse_args(["serve", "--stream-write-timeout", "0"]))
