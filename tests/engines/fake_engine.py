"""A tiny local HTTP server that answers like an engine from recorded or written fixtures,
and a ZMQ publisher for KV-event messages. Used from inside ``asyncio.run``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from aiohttp import web

Handler = Callable[[dict[str, Any]], tuple[int, Any]]


@dataclass
class FakeEngine:
    """``routes`` maps "GET /path" or "POST /path" to a fixed answer (a dict or list is
    sent as JSON, a str as text) or to a function of the posted JSON returning
    ``(status, answer)``. ``posted`` records (path, body) of every POST."""

    routes: dict[str, Any]
    posted: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        key = f"{request.method} {request.path}"
        if key not in self.routes:
            return web.Response(status=404, text="not found")
        answer = self.routes[key]
        status = 200
        if request.method == "POST":
            body = await request.json() if request.can_read_body else {}
            self.posted.append((request.path, body))
            if callable(answer):
                status, answer = answer(body)
        if isinstance(answer, dict | list):
            return web.Response(status=status, text=json.dumps(answer),
                                content_type="application/json")
        return web.Response(status=status, text=str(answer), content_type="text/plain")

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


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
