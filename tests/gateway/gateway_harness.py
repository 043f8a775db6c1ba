"""Test harness: servers run on an event loop in a background thread, tests use the
official (synchronous) ``openai`` client and plain HTTP from the test thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mori.gateway.server import bind_socket

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread; ``call(coro)`` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running: list[Running] = []
        self.handles: list[Any] = []  # other servers with an async stop()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: Any, port: int = 0) -> Running:
        """Start ``app`` on uvicorn here; it is stopped by ``close()``."""
        r = self.call(serve_app(app, port))
        self.running.append(r)
        return r

    def close(self) -> None:
        for r in [*reversed(self.running), *self.handles]:
            with contextlib.suppress(Exception):
                self.call(r.stop(), timeout=10)

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t
        with contextlib.suppress(Exception):
            self.call(cancel_all(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class Running:
    url: str
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(self.task, 5)


async def serve_app(app: Any, port: int = 0) -> Running:
    sock = bind_socket("127.0.0.1", port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            raise RuntimeError("server failed to start")
        await asyncio.sleep(0.01)
    return Running(f"http://{host}:{port}", server, task)


@dataclass
class FakeEngine:
    """A scripted OpenAI-compatible engine for fault tests.

    ``mode``: "ok", "error500" (answers 500), "die" (streams ``die_after`` chunks then
    drops the connection), "hang" (never answers). Every request body is recorded.
    """

    model: str = "fake-model"
    mode: str = "ok"
    token_delay_s: float = 0.0
    die_after: int = 2
    requests: list[dict[str, Any]] = field(default_factory=list)
    cancelled: int = 0
    active: int = 0

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            n = int(body.get("max_tokens") or 8)
            if self.mode == "error500":
                return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, 500)
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if not body.get("stream"):
                await asyncio.sleep(self.token_delay_s * n)
                return JSONResponse({
                    "id": "x", "object": "chat.completion", "model": self.model,
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": "w " * n}}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}})

            async def gen() -> AsyncIterator[bytes]:
                self.active += 1
                try:
                    for i in range(n):
                        if self.mode == "die" and i == self.die_after:
                            raise RuntimeError("engine died")
                        await asyncio.sleep(self.token_delay_s)
                        chunk = {"id": "x", "object": "chat.completion.chunk", "model": self.model,
                                 "choices": [{"index": 0, "delta": {"content": "w "},
                                              "finish_reason": None}]}
                        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
                finally:
                    self.active -= 1
            return StreamingResponse(gen(), media_type="text/event-stream")

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        async def health(request: Request) -> Response:
            return Response("ok")

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/models", models), Route("/health", health)])
