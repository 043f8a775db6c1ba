"""Serving an ASGI app with uvicorn inside the running event loop.

``serve_app`` is how the gateway starts its simulated engines, how ``mori engine-sim``
serves one, and how tests serve their apps; ``bind_socket`` is the listening socket that
``mori serve`` uses as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from dataclasses import dataclass

import uvicorn
from starlette.types import ASGIApp


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free port, read it back from ``getsockname``).
    ``OSError`` says which address could not be used."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit this: without it a response written in two parts
    # (headers, then body) waits for the client's delayed ACK, ~40 ms per request
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _InProcessServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone (its host
    application owns them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass(eq=False)
class RunningServer:
    """An app served by uvicorn in the current event loop; ``await stop()`` ends it
    (idempotent)."""

    url: str
    host: str
    port: int
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


async def serve_app(app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *,
                    grace_s: int = 2) -> RunningServer:
    """Serve ``app`` (with its lifespan) in the current event loop; ``port`` 0 picks a
    free port (reported in ``.url`` and ``.port``). Returns once the server accepts
    connections. ``grace_s``: how long ``stop()`` lets requests in flight finish before
    they are cancelled."""
    sock = bind_socket(host, port)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=grace_s)
    server = _InProcessServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]),
                                                  name=f"uvicorn:{bound}")
    while not server.started:
        if task.done():
            sock.close()
            exc = task.exception()
            raise RuntimeError(f"the server on {host}:{bound} failed to start") from exc
        await asyncio.sleep(0.005)
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    netloc = f"[{shown}]" if ":" in shown else shown
    return RunningServer(f"http://{netloc}:{bound}", host, bound, server, task)
