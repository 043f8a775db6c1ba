"""An engine that misbehaves cannot make the gateway unbounded: each case asserts the
bound, not only that nothing crashed.

The engine is a real HTTP server on 127.0.0.1 (``HostileEngine``, raw asyncio) that
answers each completion with a script: garbage, half an event, one huge line, a stall
after the first event, absurd usage, a whole (not streamed) answer over
``--max-response-bytes``. Each case checks what the client gets (an error
event in its API's shape that parses, or a status when nothing was passed on yet), the
metric that counts it, that the program is not left reasoning or in flight, that the
engine's request was aborted where the gateway gave up on it, and that ``/healthz``
still answers. Caps and timeouts are small so the suite stays fast. The stall and the
absurd usage are also run with every connection on a worker process (``--workers 2``),
whose counters reach the policy process's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
from gateway_harness import LoopThread, Running
from through_workers import WorkersGateway, workers_config

from mori.engines.http import OpenAIHTTPAdapter
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
APIS = (CHAT, MESSAGES, RESPONSES)
MSG = [{"role": "user", "content": "hi"}]
CONTEXT = 4096  # the engine's max_model_len
MAX_TOKENS = 5
CAP = 4096  # --max-sse-line-bytes in these tests
IDLE_S = 0.5  # --stream-idle-timeout in these tests
WHOLE_CAP = 64 * 1024  # --max-response-bytes in these tests (its least)
STALL = "stall"  # a script step: send nothing more until the gateway drops the connection
Step = bytes | float | str


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


FIRST = {  # each API's first event
    CHAT: b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m",
                                  "choices": [{"index": 0, "delta": {"content": "w "},
                                               "finish_reason": None}]}).encode() + b"\n\n",
    MESSAGES: event("message_start", {"type": "message_start", "message": {
        "id": "m1", "type": "message", "role": "assistant", "content": [], "model": "m",
        "usage": {"input_tokens": 3, "output_tokens": 0}}}),
    RESPONSES: event("response.created", {"type": "response.created", "response": {
        "id": "r", "object": "response", "status": "in_progress", "error": None,
        "output": []}}),
}
HALF = {  # the first half of an event
    CHAT: b'data: {"id": "x", "object": "chat.completion.chunk", "choices": [{"ind',
    MESSAGES: b'event: content_block_delta\ndata: {"type": "content_block_delta", "ind',
    RESPONSES: b'event: response.output_text.delta\ndata: {"type": "response.outp',
}
ABSURD = 10**15


def absurd_stream(path: str) -> bytes:
    """A whole stream whose usage says 1e15 tokens in and out."""
    if path == CHAT:
        return FIRST[CHAT] + b"data: " + json.dumps({
            "id": "x", "object": "chat.completion.chunk", "model": "m", "choices": [],
            "usage": {"prompt_tokens": ABSURD, "completion_tokens": ABSURD}}).encode() \
            + b"\n\ndata: [DONE]\n\n"
    if path == MESSAGES:
        start = event("message_start", {"type": "message_start", "message": {
            "id": "m1", "type": "message", "role": "assistant", "content": [], "model": "m",
            "usage": {"input_tokens": ABSURD, "cache_read_input_tokens": ABSURD,
                      "output_tokens": 0}}})
        return start + event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": ABSURD}}) + event("message_stop",
                                                         {"type": "message_stop"})
    return FIRST[RESPONSES] + event("response.completed", {
        "type": "response.completed", "response": {
            "id": "r", "status": "completed", "error": None, "output": [],
            "usage": {"input_tokens": ABSURD, "output_tokens": ABSURD}}})


def absurd_answer(path: str) -> dict[str, Any]:
    """A whole (not streamed) answer whose usage says 1e15 tokens in and out."""
    if path == MESSAGES:
        return {"id": "m1", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": "w"}], "stop_reason": "end_turn",
                "usage": {"input_tokens": ABSURD, "output_tokens": ABSURD}}
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "w"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": ABSURD, "completion_tokens": ABSURD}}


class HostileEngine:
    """An OpenAI-compatible engine on 127.0.0.1 that answers its streamed completions
    with ``scripts`` in turn, the last one again once all were used (a stream: its body,
    no framing, ends when the connection closes), and the others with ``answer`` (a
    whole JSON answer) or, given, the script ``whole`` (raw: the head included; the
    connection closed after it). A script's steps: bytes are sent, a float
    is slept, ``STALL`` waits for the gateway to drop the connection. ``GET /health``
    and ``/v1/models`` (model ``m``, ``max_model_len`` ``CONTEXT``) answer 200.

    Records (read from the test's thread): ``probes`` (health checks), ``dropped``
    (set when the gateway closed a connection before its script was done)."""

    def __init__(self, *scripts: Sequence[Step], answer: dict[str, Any] | None = None,
                 whole: Sequence[Step] | None = None) -> None:
        self.scripts = [list(s) for s in scripts] or [[]]
        self.answer = answer
        self.whole = whole
        self.streams = 0
        self.probes = 0
        self.dropped = threading.Event()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:  # for LoopThread.close
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                body = await reader.readexactly(int(m.group(1)) if m else 0)
                line = head.split(b"\r\n", 1)[0]
                if line.startswith(b"GET"):
                    await self._get(line, writer)
                    continue
                if json.loads(body).get("stream"):
                    await self._stream(reader, writer)
                elif self.whole is not None:
                    await self._play(self.whole, reader, writer)
                else:
                    data = json.dumps(self.answer).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
                    await writer.drain()
                    continue
                break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _get(self, line: bytes, writer: asyncio.StreamWriter) -> None:
        if b" /health " in line:
            self.probes += 1
        data = json.dumps({"object": "list", "data": [
            {"id": "m", "object": "model", "max_model_len": CONTEXT}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(data), data))
        await writer.drain()

    async def _stream(self, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"connection: close\r\n\r\n")
        script = self.scripts[min(self.streams, len(self.scripts) - 1)]
        self.streams += 1
        await self._play(script, reader, writer)

    async def _play(self, script: Sequence[Step], reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:
        try:
            for step in script:
                if isinstance(step, bytes):
                    writer.write(step)
                    await writer.drain()
                elif isinstance(step, float):
                    await asyncio.sleep(step)
                else:  # STALL: the gateway's close shows as EOF here
                    await reader.read()
                    self.dropped.set()
                    return
        except ConnectionError:
            self.dropped.set()


def gateway(lt: LoopThread, engine: HostileEngine, **settings: Any) -> Running:
    lt.call(engine.start())
    lt.handles.append(engine)
    s = GatewaySettings(**{"stream_idle_timeout_s": IDLE_S, "max_sse_line_bytes": CAP,
                           "max_response_bytes": WHOLE_CAP, "health_interval_s": 60.0,
                           **settings})
    return lt.serve(create_app(s, [OpenAIHTTPAdapter(engine.url, kv_tokens=100_000)]))


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


def request(path: str, pid: str, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "stream": stream, "program_id": pid}
    if path == RESPONSES:
        return {**body, "input": "hi", "max_output_tokens": MAX_TOKENS}
    return {**body, "messages": MSG, "max_tokens": MAX_TOKENS}


def stream(url: str, path: str, pid: str) -> tuple[int, str]:
    with httpx.stream("POST", url + path, json=request(path, pid), timeout=30) as r:
        return r.status_code, r.read().decode("latin-1")


def events(text: str) -> list[tuple[str | None, Any]]:
    """The stream's events as (event name, parsed data), as an SSE client dispatches
    them; every event must parse (a ``[DONE]`` is kept as the string)."""
    out: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if not data:  # no data: an SSE client dispatches nothing
            continue
        payload = "\n".join(data)
        out.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return out


def stream_error_message(path: str, text: str) -> str:
    """The message of the error event the stream ends with, in its API's shape."""
    evs = events(text)
    if path == CHAT:
        assert evs[-1] == (None, "[DONE]"), evs[-1]
        return str(evs[-2][1]["error"]["message"])
    name, data = evs[-1]
    assert name == "error" and data["type"] == "error", evs[-1]
    return str(data["error"]["message"] if path == MESSAGES else data["message"])


def error_message(path: str, r: httpx.Response) -> str:
    """The message of an error answer, in its API's shape."""
    body = r.json()
    if path == MESSAGES:
        assert body["type"] == "error"
    return str(body["error"]["message"])


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def program(url: str, pid: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/programs/{pid}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def assert_step_ended(url: str, pid: str) -> None:
    """The program is not left reasoning nor in flight, and the gateway still answers."""
    wait_for(lambda: not program(url, pid)["in_flight"])
    assert program(url, pid)["status"] != "reasoning"
    assert httpx.get(url + "/healthz", timeout=5).status_code == 200


# -- garbage and half events -----------------------------------------------------------------

@pytest.mark.parametrize("path", APIS)
def test_garbage_is_passed_on_then_ends_in_a_clean_error_event(lt: LoopThread,
                                                               path: str) -> None:
    garbage = b"\x00\xff\xfe not SSE\n\n\x1b[2J{{{{\n\n"
    gw = gateway(lt, HostileEngine([FIRST[path], garbage]))
    status, text = stream(gw.url, path, "g")
    assert status == 200
    assert text.startswith(FIRST[path].decode() + garbage.decode("latin-1"))
    assert "ended its stream before its answer's end" in stream_error_message(
        path, text[len(FIRST[path]) + len(garbage):])
    assert_step_ended(gw.url, "g")


@pytest.mark.parametrize("path", APIS)
def test_half_an_event_before_anything_else_is_a_502(lt: LoopThread, path: str) -> None:
    gw = gateway(lt, HostileEngine([HALF[path].rpartition(b"\n")[2]]))  # no whole line
    r = httpx.post(gw.url + path, json=request(path, "h"), timeout=30)
    assert r.status_code == 502
    assert "ended its stream before its answer's end" in error_message(path, r)
    assert_step_ended(gw.url, "h")


@pytest.mark.parametrize("path", APIS)
def test_half_an_event_mid_stream_is_dropped_for_a_clean_error_event(lt: LoopThread,
                                                                     path: str) -> None:
    gw = gateway(lt, HostileEngine([FIRST[path], 0.05, HALF[path]]))
    status, text = stream(gw.url, path, "h")
    assert status == 200 and text.startswith(FIRST[path].decode())
    assert HALF[path].decode() not in text  # every event the client reads parses
    assert "ended its stream before its answer's end" in stream_error_message(path, text)
    assert_step_ended(gw.url, "h")


def test_an_event_left_open_is_closed_before_the_error_event(lt: LoopThread) -> None:
    open_event = FIRST[CHAT][:-1]  # its line whole, its blank line missing
    gw = gateway(lt, HostileEngine([open_event]))
    status, text = stream(gw.url, CHAT, "o")
    assert status == 200
    evs = events(text)  # the error is an event of its own, not glued to the last one
    assert evs[0][1]["choices"][0]["delta"]["content"] == "w "
    assert "error" in evs[1][1] and evs[-1] == (None, "[DONE]")


# -- one huge line ---------------------------------------------------------------------------

HUGE = [b"data: {\"x\": \"" + b"a" * 4000] + [b"a" * 4096] * 64  # 262 KiB, no line end


@pytest.mark.parametrize("path", APIS)
@pytest.mark.parametrize("where", ["first", "mid-stream"])
def test_a_line_over_the_cap_ends_the_stream_and_aborts_the_request(
        lt: LoopThread, path: str, where: str) -> None:
    head = [FIRST[path], 0.05] if where == "mid-stream" else []
    engine = HostileEngine([*head, *HUGE, b"\n\n", STALL])
    gw = gateway(lt, engine)
    with httpx.stream("POST", gw.url + path, json=request(path, "big"), timeout=30) as r:
        text = r.read().decode("latin-1")
    if where == "first":  # nothing passed on yet: a status
        assert r.status_code == 502
        message = json.loads(text)["error"]["message"]
    else:
        assert r.status_code == 200 and text.startswith(FIRST[path].decode())
        assert len(text) < 2 * CAP  # the partial line was not passed on
        message = stream_error_message(path, text)
    assert f"sent an SSE line over {CAP} bytes" in message
    assert "127.0.0.1" not in message
    assert engine.dropped.wait(5)  # the engine's request aborted
    assert metric(gw.url, "mori_sse_lines_too_long_total") == 1
    assert_step_ended(gw.url, "big")


def test_a_long_line_within_the_cap_passes_whole(lt: LoopThread) -> None:
    delta = "b" * 3000
    line = b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk",
                                   "choices": [{"index": 0, "delta": {"content": delta},
                                                "finish_reason": None}]}).encode()
    pieces = [line[i:i + 100] for i in range(0, len(line), 100)]
    gw = gateway(lt, HostileEngine([*pieces, b"\n\n", b"data: [DONE]\n\n"]))
    status, text = stream(gw.url, CHAT, "long")
    assert status == 200
    assert events(text)[0][1]["choices"][0]["delta"]["content"] == delta
    assert metric(gw.url, "mori_sse_lines_too_long_total") == 0


# -- stalls ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", APIS)
def test_a_stall_mid_stream_ends_within_the_idle_timeout(lt: LoopThread, path: str) -> None:
    engine = HostileEngine([FIRST[path], STALL])
    gw = gateway(lt, engine)
    probes = engine.probes
    t0 = time.monotonic()
    status, text = stream(gw.url, path, "s")
    took = time.monotonic() - t0
    assert status == 200 and text.startswith(FIRST[path].decode())
    assert IDLE_S <= took <= IDLE_S + 5
    message = stream_error_message(path, text)
    assert "sent nothing mid-stream" in message and "127.0.0.1" not in message
    assert engine.dropped.wait(5)
    assert metric(gw.url, "mori_stream_timeouts_total") == 1
    assert metric(gw.url, "mori_upstream_idle_timeouts_total") == 1
    assert_step_ended(gw.url, "s")
    wait_for(lambda: engine.probes > probes)  # the replica probed at once
    row = httpx.get(gw.url + "/healthz").json()["replicas"][0]
    assert row["healthy"] is True and row["in_flight"] == 0


def test_a_trickle_within_the_idle_timeout_is_not_cut(lt: LoopThread) -> None:
    chunk = FIRST[CHAT]
    gw = gateway(lt, HostileEngine([chunk, 0.3, chunk, 0.3, chunk, b"data: [DONE]\n\n"]))
    status, text = stream(gw.url, CHAT, "t")  # 0.6 s in all, each gap under IDLE_S
    assert status == 200 and text == (chunk * 3 + b"data: [DONE]\n\n").decode()
    assert metric(gw.url, "mori_upstream_idle_timeouts_total") == 0


def test_a_stall_before_the_first_byte_is_a_504(lt: LoopThread) -> None:
    engine = HostileEngine([STALL])
    gw = gateway(lt, engine, first_byte_timeout_s=1.0)
    t0 = time.monotonic()
    r = httpx.post(gw.url + MESSAGES, json=request(MESSAGES, "f"), timeout=30)
    assert 1.0 <= time.monotonic() - t0 <= 6.0
    assert r.status_code == 504
    assert "began no answer" in error_message(MESSAGES, r)
    assert engine.dropped.wait(5)
    assert metric(gw.url, "mori_upstream_idle_timeouts_total") == 1
    assert_step_ended(gw.url, "f")


# -- absurd usage ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", APIS)
def test_absurd_usage_in_a_stream_is_clamped(lt: LoopThread, path: str) -> None:
    gw = gateway(lt, HostileEngine([absurd_stream(path)]))
    status, text = stream(gw.url, path, "u")
    assert status == 200 and text == absurd_stream(path).decode()  # passed on untouched
    assert_step_ended(gw.url, "u")
    assert metric(gw.url, "mori_usage_clamped_total") == 1
    assert metric(gw.url, "mori_prompt_tokens_total") == CONTEXT
    assert metric(gw.url, "mori_completion_tokens_total") == MAX_TOKENS
    assert program(gw.url, "u")["context_tokens"] == CONTEXT + MAX_TOKENS


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_absurd_usage_in_a_whole_answer_is_clamped(lt: LoopThread, path: str) -> None:
    gw = gateway(lt, HostileEngine(answer=absurd_answer(path)))
    r = httpx.post(gw.url + path, json=request(path, "w", stream=False), timeout=30)
    assert r.status_code == 200 and r.json()["usage"] == absurd_answer(path)["usage"]
    assert_step_ended(gw.url, "w")
    assert metric(gw.url, "mori_usage_clamped_total") == 1
    assert metric(gw.url, "mori_prompt_tokens_total") == CONTEXT
    assert program(gw.url, "w")["context_tokens"] == CONTEXT + MAX_TOKENS


def test_true_usage_is_booked_as_it_is(lt: LoopThread) -> None:
    whole = absurd_answer(CHAT)
    whole["usage"] = {"prompt_tokens": 40, "completion_tokens": 3}
    gw = gateway(lt, HostileEngine(answer=whole))
    r = httpx.post(gw.url + CHAT, json=request(CHAT, "ok", stream=False), timeout=30)
    assert r.status_code == 200
    assert metric(gw.url, "mori_usage_clamped_total") == 0
    assert metric(gw.url, "mori_prompt_tokens_total") == 40
    assert program(gw.url, "ok")["context_tokens"] == 43


# -- a whole answer over --max-response-bytes -------------------------------------------------

FRAMINGS = ("content-length", "chunked", "until-close")


def big_answer(path: str, text_bytes: int) -> bytes:
    """A whole answer in ``path``'s shape whose text is ``text_bytes`` long."""
    answer = absurd_answer(path)
    answer["usage"] = {"prompt_tokens": 3, "completion_tokens": 1} if path == CHAT else \
        {"input_tokens": 3, "output_tokens": 1}
    text = "w" * text_bytes
    if path == MESSAGES:
        answer["content"][0]["text"] = text
    else:
        answer["choices"][0]["message"]["content"] = text
    return json.dumps(answer).encode()


def whole_script(framing: str, data: bytes) -> list[Step]:
    """``data`` as a whole answer framed by its length, in chunks, or by the connection's
    end, sent in 16 KiB pieces; then the engine waits for the gateway to leave."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    pieces = [data[i:i + 16384] for i in range(0, len(data), 16384)]
    if framing == "content-length":
        return [head + b"content-length: %d\r\n\r\n" % len(data), *pieces, STALL]
    if framing == "chunked":
        return [head + b"transfer-encoding: chunked\r\n\r\n",
                *(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces), b"0\r\n\r\n", STALL]
    return [head + b"connection: close\r\n\r\n", *pieces, STALL]


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_whole_answer_over_the_cap_is_a_502_and_aborts_the_request(
        lt: LoopThread, path: str, framing: str) -> None:
    engine = HostileEngine(whole=whole_script(framing, big_answer(path, 1 << 20)))
    gw = gateway(lt, engine)
    r = httpx.post(gw.url + path, json=request(path, "whole", stream=False), timeout=30)
    assert r.status_code == 502
    if path == MESSAGES:
        assert r.json()["error"]["type"] == "api_error"
    message = error_message(path, r)
    assert f"sent an answer over {WHOLE_CAP} bytes (--max-response-bytes" in message
    assert "127.0.0.1" not in message
    assert engine.dropped.wait(5)  # the engine's request aborted
    assert metric(gw.url, "mori_responses_too_large_total") == 1
    assert_step_ended(gw.url, "whole")
    row = httpx.get(gw.url + "/healthz").json()["replicas"][0]
    assert row["healthy"] is True and row["in_flight"] == 0  # one answer: not a dead engine


@pytest.mark.parametrize("path", [CHAT, MESSAGES])
def test_a_whole_answer_within_the_cap_passes(lt: LoopThread, path: str) -> None:
    data = big_answer(path, WHOLE_CAP - 1024)
    assert WHOLE_CAP - 1024 < len(data) <= WHOLE_CAP
    engine = HostileEngine(whole=whole_script("chunked", data))
    gw = gateway(lt, engine)
    r = httpx.post(gw.url + path, json=request(path, "fits", stream=False), timeout=30)
    assert r.status_code == 200 and r.content == data
    assert metric(gw.url, "mori_responses_too_large_total") == 0
    assert_step_ended(gw.url, "fits")


# -- through a worker process ----------------------------------------------------------------

def test_bounds_hold_on_a_worker_and_are_counted_in_metrics(lt: LoopThread) -> None:
    engine = HostileEngine([FIRST[MESSAGES], STALL], [*HUGE, STALL],
                           [absurd_stream(MESSAGES)],
                           whole=whole_script("chunked", big_answer(MESSAGES, 1 << 20)))
    lt.call(engine.start())
    lt.handles.append(engine)
    settings = GatewaySettings(stream_idle_timeout_s=IDLE_S, max_sse_line_bytes=CAP,
                               max_response_bytes=WHOLE_CAP, health_interval_s=60.0)
    wg = WorkersGateway(lt, workers_config(
        backends=[f"openai={engine.url},kv_tokens=100000"], settings=settings))
    try:
        t0 = time.monotonic()
        status, text = stream(wg.url, MESSAGES, "stalls")
        assert status == 200 and time.monotonic() - t0 <= IDLE_S + 5
        assert "sent nothing mid-stream" in stream_error_message(MESSAGES, text)
        r = httpx.post(wg.url + MESSAGES, json=request(MESSAGES, "huge"), timeout=30)
        assert r.status_code == 502
        assert f"sent an SSE line over {CAP} bytes" in error_message(MESSAGES, r)
        status, text = stream(wg.url, MESSAGES, "absurd")
        assert status == 200 and text == absurd_stream(MESSAGES).decode()
        assert engine.dropped.wait(5)  # the stall's and the huge line's, long since
        engine.dropped.clear()
        r = httpx.post(wg.url + MESSAGES, json=request(MESSAGES, "whole", stream=False),
                       timeout=30)
        assert r.status_code == 502
        assert f"sent an answer over {WHOLE_CAP} bytes" in error_message(MESSAGES, r)
        assert engine.dropped.wait(5)
        wait_for(lambda: metric(wg.url, "mori_responses_too_large_total") == 1)
        wait_for(lambda: metric(wg.url, "mori_upstream_idle_timeouts_total") == 1)
        wait_for(lambda: metric(wg.url, "mori_usage_clamped_total") == 1)
        assert metric(wg.url, "mori_stream_timeouts_total") == 1
        assert metric(wg.url, "mori_sse_lines_too_long_total") == 1
        assert metric(wg.url, "mori_prompt_tokens_total") <= 100_000
        for pid in ("stalls", "huge", "absurd", "whole"):
            assert_step_ended(wg.url, pid)
    finally:
        wg.close()
