"""Raw asyncio servers for the HTTP/1.1 client's tests (``test_h1``, ``test_h1_failures``):
every byte the "engine" sends is under the test's control."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import Awaitable, Callable

from mori.engines.http1_client import H1Pool

Handler = Callable[["Server", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A raw TCP server on a free 127.0.0.1 port; ``handler`` serves one connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.accepted = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.eofs = 0  # connections the client closed (EOF seen by a handler)
        self.eof = asyncio.Event()
        self.url = ""
        self._srv: asyncio.Server | None = None

    async def __aenter__(self) -> Server:
        self._srv = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._srv.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._srv is not None
        self._srv.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # (a handler still waiting when the test ends is cancelled: end quietly)
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One whole request (its head is returned), or None at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        m = re.search(rb"content-length: (\d+)", head, re.I)
        body = await reader.readexactly(int(m.group(1))) if m else b""
        self.requests.append((head, body))
        return head

    async def wait_eof(self, reader: asyncio.StreamReader) -> None:
        while await reader.read(65536):
            pass
        self.eofs += 1
        self.eof.set()


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 5))


def pool(url: str, read_timeout: float | None = 2.0, **kw: int) -> H1Pool:
    return H1Pool(url, connect_timeout=1.0, read_timeout=read_timeout, **kw)


def answer(body: bytes, *extra: bytes, version: bytes = b"1.1") -> bytes:
    return (b"HTTP/" + version + b" 200 OK\r\ncontent-type: application/json\r\n"
            + b"".join(h + b"\r\n" for h in extra)
            + b"content-length: %d\r\n\r\n" % len(body) + body)


def keep_alive(body: bytes = b'{"ok":1}', *extra: bytes) -> Handler:
    """Answers every request on the connection with ``body``."""
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await s.request(r) is not None:
            w.write(answer(body, *extra))
        s.eofs += 1
        s.eof.set()
    return handler


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
