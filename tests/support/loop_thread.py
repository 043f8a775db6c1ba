"""An asyncio loop in a background thread, so that a synchronous test (the official
``openai`` client, ``httpx``, or ``asyncio.run`` of a client) can talk to servers running
on it. Apps are served with ``mori.protocol.serve.serve_app``, like MORI's own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import ASGIApp

from mori.protocol.serve import RunningServer, serve_app

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread; ``call(coro)`` runs a coroutine there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.running: list[RunningServer] = []
        self.handles: list[Any] = []  # other servers with an async stop()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def serve(self, app: ASGIApp, port: int = 0) -> RunningServer:
        """Start ``app`` on uvicorn here; it is stopped by ``close()``."""
        r = self.call(serve_app(app, port=port, grace_s=1))
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
