"""A scripted OpenAI-compatible engine for tests, and a ZMQ publisher of KV events.

``FakeEngine`` is a Starlette app (``app()``), served with ``mori.protocol.serve``:
``await start()`` in the running loop, or ``LoopThread.serve(fake.app())``.

- Chat completions: ``max_tokens`` tokens (default 8) of ``"w "`` each, streamed (with a
  last usage chunk when ``stream_options.include_usage``) or whole, ``token_delay_s``
  apart. Faults, per request (``n`` counts chat requests from 0): ``fail(body, n)``
  returns a status to answer instead (with ``{"error": {"message": "boom"}}``),
  ``hang(body, n)`` never answers, ``die(body, n)`` drops the connection after
  ``die_after`` chunks, ``stream_error(body, n)`` sends an error event after the first
  token and ends the stream. ``mode`` sets one fault for every request: ``"error500"``,
  ``"hang"`` or ``"die"`` (``"ok"``: none).
- ``GET /v1/models`` (``model``, with ``max_model_len`` if given), ``GET /health``.
- ``gateway=True``: answers like a MORI gateway too: ``GET /v1/programs``,
  ``POST /v1/programs/{id}/release`` and its counters on ``/metrics`` (else 404).
- ``routes``: fixed answers that take precedence, by ``"METHOD /path"``: a dict or list
  is sent as JSON, a str as text, a function of the posted JSON returns
  ``(status, answer)`` (adapter tests replay recorded engine answers this way).

Records: ``requests`` (each chat request's body, arrival and finish times, status),
``posted`` (path and JSON of every POST), ``releases``, ``probes`` (models, programs,
metrics), ``cancelled`` and ``active`` streams.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mori.protocol.serve import RunningServer, serve_app

Predicate = Callable[[dict[str, Any], int], Any]
MODES = ("ok", "error500", "hang", "die")


def always(body: dict[str, Any], n: int) -> bool:
    return True


@dataclass
class Received:
    """One chat request as the engine saw it (``time.monotonic`` times)."""

    body: dict[str, Any]
    arrived: float
    finished: float | None = None
    status: int = 200


@dataclass
class FakeEngine:
    """See the module docstring."""

    model: str = "fake-model"
    mode: str = "ok"
    token_delay_s: float = 0.0
    die_after: int = 2
    max_model_len: int | None = None
    fail: Predicate | None = None
    hang: Predicate | None = None
    die: Predicate | None = None
    stream_error: Predicate | None = None
    gateway: bool = False
    routes: dict[str, Any] = field(default_factory=dict)
    requests: list[Received] = field(default_factory=list)
    posted: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    posted_headers: list[dict[str, str]] = field(default_factory=list)  # as ``posted``
    releases: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)
    promotions: int = 0
    cancelled: int = 0
    active: int = 0
    url: str = ""
    server: RunningServer | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.mode == "error500":
            self.fail = lambda body, n: 500
        elif self.mode == "hang":
            self.hang = always
        elif self.mode == "die":
            self.die = always

    # -- serving ---------------------------------------------------------------------
    async def start(self, port: int = 0) -> FakeEngine:
        """Serve in the running loop; ``url`` is then set."""
        self.server = await serve_app(self.app(), port=port, grace_s=1)
        self.url = self.server.url
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    def chat_bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]

    def app(self) -> Starlette:
        fixed = [Route(key.split(" ", 1)[1], self._fixed(key), methods=[key.split(" ", 1)[0]])
                 for key in self.routes]
        return Starlette(routes=[
            *fixed,
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/health", self.health),
            Route("/v1/programs", self.programs),
            Route("/v1/programs/{pid:path}/release", self.release, methods=["POST"]),
            Route("/metrics", self.metrics),
        ])

    # -- fixed answers ---------------------------------------------------------------
    def _fixed(self, key: str) -> Callable[[Request], Any]:
        async def answer(request: Request) -> Response:
            reply = self.routes[key]
            status = 200
            if request.method == "POST":
                raw = await request.body()
                body = json.loads(raw) if raw else {}
                self.posted.append((request.url.path, body))
                self.posted_headers.append(dict(request.headers))
                if callable(reply):
                    status, reply = reply(body)
            if isinstance(reply, dict | list):
                return JSONResponse(reply, status_code=status)
            return PlainTextResponse(str(reply), status_code=status)
        return answer

    # -- the scripted engine ---------------------------------------------------------
    async def models(self, request: Request) -> Response:
        self.probes.append("models")
        entry: dict[str, Any] = {"id": self.model, "object": "model"}
        if self.max_model_len is not None:
            entry["max_model_len"] = self.max_model_len
        return JSONResponse({"object": "list", "data": [entry]})

    async def health(self, request: Request) -> Response:
        return Response("ok")

    async def programs(self, request: Request) -> Response:
        self.probes.append("programs")
        if not self.gateway:
            return JSONResponse({"error": "not found"}, status_code=404)
        return JSONResponse({"programs": []})

    async def release(self, request: Request) -> Response:
        self.releases.append(request.path_params["pid"])
        if not self.gateway:
            return JSONResponse({"error": "not found"}, status_code=404)
        return JSONResponse({"released": request.path_params["pid"]})

    async def metrics(self, request: Request) -> Response:
        self.probes.append("metrics")
        if not self.gateway:
            return PlainTextResponse("not found", status_code=404)
        text = ("# TYPE mori_promotions counter\n"
                f'mori_promotions_total{{source="none"}} {self.promotions}\n'
                f'mori_promotions_total{{source="cpu"}} 1\n'
                "# TYPE mori_demotions counter\n"
                f'mori_demotions_total{{to="cpu"}} {2 * self.promotions}\n')
        return PlainTextResponse(text)

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.posted.append((request.url.path, body))
        n = len(self.requests)
        rec = Received(body, time.monotonic())
        self.requests.append(rec)
        if self.gateway:
            self.promotions += 1
        if self.hang is not None and self.hang(body, n):
            await asyncio.sleep(3600)
        status = self.fail(body, n) if self.fail is not None else None
        if status:
            rec.status = status
            rec.finished = time.monotonic()
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}},
                                status_code=status)
        tokens = int(body.get("max_tokens") or 8)
        if not body.get("stream"):
            await asyncio.sleep(self.token_delay_s * tokens)
            rec.finished = time.monotonic()
            return JSONResponse({
                "id": "x", "object": "chat.completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "finish_reason": "length",
                             "message": {"role": "assistant", "content": "w " * tokens}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": tokens,
                          "total_tokens": tokens + 5}})
        broken = self.stream_error is not None and self.stream_error(body, n)
        dies = self.die is not None and self.die(body, n)
        opts = body.get("stream_options")
        usage = isinstance(opts, dict) and opts.get("include_usage") is True
        return StreamingResponse(self._stream(rec, tokens, usage, broken, dies),
                                 media_type="text/event-stream")

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        data = {"id": "x", "object": "chat.completion.chunk", "created": 0,
                "model": self.model, "choices": choices, **extra}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    async def _stream(self, rec: Received, tokens: int, usage: bool, broken: bool,
                      dies: bool) -> AsyncIterator[bytes]:
        self.active += 1
        try:
            for i in range(tokens):
                if dies and i == self.die_after:
                    rec.status = 598
                    rec.finished = time.monotonic()
                    raise RuntimeError("the engine died mid-stream")
                await asyncio.sleep(self.token_delay_s)
                yield self._chunk([{"index": 0, "delta": {"content": "w "},
                                    "finish_reason": None}])
                if broken and i == 0:
                    rec.status = 599
                    rec.finished = time.monotonic()
                    yield b"data: " + json.dumps(
                        {"error": {"message": "engine died"}}).encode() + b"\n\n"
                    return
            if usage:
                yield self._chunk([], usage={"prompt_tokens": 5, "completion_tokens": tokens,
                                             "total_tokens": tokens + 5})
            yield b"data: [DONE]\n\n"
            rec.finished = time.monotonic()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


class Publisher:
    """A ZMQ PUB socket on a free local port, sending multipart messages."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
