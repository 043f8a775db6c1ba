"""A tiny OpenAI-compatible server for the replay tests (Starlette + uvicorn, in a thread).

It streams ``max_tokens`` one-token chunks and a usage chunk, records every request it
gets with its arrival and finish times (``time.monotonic``), and answers 404 to
``/v1/programs/...`` unless built with ``gateway=True`` (then it lists programs, accepts
releases and exposes MORI's counters on ``/metrics``). ``fail(body, n)`` may return an
HTTP status to answer instead (n counts chat requests from 0), ``stream_error(body, n)``
True to send an error event after the first token, ``die(body, n)`` True to break the
connection after the first token, ``hang(body, n)`` True to never answer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

Predicate = Callable[[dict[str, Any], int], Any]


@dataclass
class Received:
    body: dict[str, Any]
    arrived: float
    finished: float | None = None
    status: int = 200


@dataclass
class FakeServer:
    gateway: bool = False
    token_delay_s: float = 0.0
    max_model_len: int | None = None
    fail: Predicate | None = None
    stream_error: Predicate | None = None
    hang: Predicate | None = None
    die: Predicate | None = None
    requests: list[Received] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    probes: list[str] = field(default_factory=list)
    promotions: int = 0
    url: str = ""
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    # -- the app ---------------------------------------------------------------------
    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/programs", self.programs),
            Route("/v1/programs/{pid:path}/release", self.release, methods=["POST"]),
            Route("/metrics", self.metrics),
        ])

    async def models(self, request: Request) -> Response:
        self.probes.append("models")
        entry: dict[str, Any] = {"id": "tiny", "object": "model"}
        if self.max_model_len is not None:
            entry["max_model_len"] = self.max_model_len
        return JSONResponse({"object": "list", "data": [entry]})

    async def programs(self, request: Request) -> Response:
        self.probes.append("programs")
        if not self.gateway:
            return JSONResponse({"error": "not found"}, status_code=404)
        return JSONResponse({"programs": []})

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

    async def release(self, request: Request) -> Response:
        self.releases.append(request.path_params["pid"])
        if not self.gateway:
            return JSONResponse({"error": "not found"}, status_code=404)
        return JSONResponse({"released": request.path_params["pid"]})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
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
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=status)
        broken = self.stream_error is not None and self.stream_error(body, n)
        dies = self.die is not None and self.die(body, n)
        return StreamingResponse(self._stream(body, rec, broken, dies),
                                 media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], rec: Received, broken: bool, dies: bool
                      ) -> AsyncIterator[str]:
        tokens = int(body["max_tokens"])
        for i in range(tokens):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
            if broken and i == 0:
                rec.status = 599
                rec.finished = time.monotonic()
                yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
                return
            if dies and i == 0:
                rec.status = 598
                rec.finished = time.monotonic()
                raise RuntimeError("the engine died mid-stream")
        usage = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "tiny",
                 "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                          "total_tokens": tokens + 1}}
        yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
        rec.finished = time.monotonic()

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> FakeServer:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app(), log_level="critical", lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            self._thread.join(timeout=10)

    def chat_bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests]
