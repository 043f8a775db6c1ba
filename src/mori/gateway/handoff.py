"""Connections dealt out to the gateway's processes (``mori serve --workers N``).

The policy process accepts every connection on the gateway's port. It serves the first
``keep`` open ones itself, where a request needs no admission round trip (one client
alone sees one process's latency), and hands each further one to a worker, in turn,
over a local ``SOCK_SEQPACKET`` socket pair per worker (the socket itself passes, with
``SCM_RIGHTS``; the policy process then closes its copy). A worker that is gone or
cannot take it is skipped; with none left the policy process serves it itself.

Both sides serve a socket accepted elsewhere with uvicorn's own HTTP protocol class
(``protocol_factory``: ``config.http_protocol_class``, the gateway's bounded one), so it
behaves as one uvicorn accepted: the same app, the same bounds on the connection
(``mori.gateway.bounds``: head and body limits and timeouts, keep-alive, the cap on open
connections, which counts it in the process that serves it) and the same shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

log = logging.getLogger("mori.gateway")

ProtocolFactory = Callable[[], asyncio.Protocol]
ACCEPT_PAUSE_S = 1.0
"""After a failed accept (out of file descriptors), the pause before accepting again."""
KEEP = 2
"""Connections the policy process keeps open itself before it hands new ones on: two, so
that a client that opens a connection and closes it again just before its real one (as
``wrk`` does) still has the real one served here."""


def protocol_factory(server: uvicorn.Server) -> ProtocolFactory:
    """uvicorn's HTTP protocol bound to ``server`` (started: its config is loaded), for
    sockets it did not accept itself."""
    config = server.config
    cls: Any = getattr(config, "http_protocol_class", None)
    lifespan = getattr(server, "lifespan", None)
    if cls is None or lifespan is None or not server.started:
        raise RuntimeError("cannot serve handed-over connections: the uvicorn server has "
                           "not started, or this uvicorn lacks config.http_protocol_class "
                           "(mori needs uvicorn >= 0.29)")
    state = server.server_state

    def make() -> asyncio.Protocol:
        proto: asyncio.Protocol = cls(config=config, server_state=state,
                                      app_state=lifespan.state)
        return proto

    return make


class Served:
    """Serves accepted sockets with a protocol factory; counts those still open."""

    def __init__(self, factory: ProtocolFactory) -> None:
        self.factory = factory
        self._open: set[asyncio.BaseTransport] = set()
        self._starting: set[asyncio.Task[Any]] = set()

    def open_count(self) -> int:
        self._open = {t for t in self._open if not t.is_closing()}
        return len(self._open) + len(self._starting)

    def serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(self.factory, conn))
        self._starting.add(task)
        task.add_done_callback(lambda t: self._started(t, conn))

    def _started(self, task: asyncio.Task[Any], conn: socket.socket) -> None:
        self._starting.discard(task)
        if task.cancelled() or task.exception() is not None:
            log.debug("a handed-over connection could not be served: %r",
                      None if task.cancelled() else task.exception())
            conn.close()
            return
        transport, _ = task.result()
        self._open.add(transport)

    def close(self) -> None:
        for t in self._starting:
            t.cancel()


class Dealer:
    """The policy process's side: accepts on ``listener`` and deals the connections out
    (``keep`` served here through ``here``, the rest to the workers' lines)."""

    def __init__(self, listener: socket.socket, here: Served, keep: int = KEEP,
                 on_dealt: Callable[[int], None] = lambda worker: None) -> None:
        self.listener = listener
        self.here = here
        self.keep = keep
        self.on_dealt = on_dealt  # called with the worker's number, 0 for this process
        self.lines: dict[int, socket.socket] = {}  # worker number -> this process's end
        self._turn = 0
        self._stopped = False

    def line(self, worker: int) -> socket.socket:
        """A new line to ``worker`` (replacing its old one). Returns the worker's end:
        the worker process inherits it; close it here once the process has started."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        old = self.lines.pop(worker, None)
        if old is not None:
            old.close()
        self.lines[worker] = mine
        return theirs

    def start(self) -> None:
        self.listener.setblocking(False)
        asyncio.get_running_loop().add_reader(self.listener.fileno(), self._accept)

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.listener.fileno())
        for line in self.lines.values():
            line.close()
        self.lines.clear()
        self.here.close()

    def _accept(self) -> None:
        for _ in range(64):  # then let the loop run: more are taken on the next turn
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, ...: the connection waits in the queue
                log.warning("accepting a connection failed (%s); trying again in %g s", e,
                            ACCEPT_PAUSE_S)
                loop = asyncio.get_running_loop()
                loop.remove_reader(self.listener.fileno())
                loop.call_later(ACCEPT_PAUSE_S, self._resume)
                return
            self.deal(conn)

    def _resume(self) -> None:
        if not self._stopped and self.listener.fileno() != -1:
            asyncio.get_running_loop().add_reader(self.listener.fileno(), self._accept)

    def deal(self, conn: socket.socket) -> None:
        if self.here.open_count() < self.keep or not self.lines:
            self._serve_here(conn)
            return
        workers = sorted(self.lines)
        for k in range(len(workers)):
            w = workers[(self._turn + k) % len(workers)]
            try:
                socket.send_fds(self.lines[w], [b"c"], [conn.fileno()])
            except OSError:  # gone (being started again) or not reading: the next one
                continue
            self._turn = (self._turn + k + 1) % len(workers)
            conn.close()
            self.on_dealt(w)
            return
        self._serve_here(conn)

    def _serve_here(self, conn: socket.socket) -> None:
        self.here.serve(conn)
        self.on_dealt(0)


def take_connections(line: socket.socket, here: Served) -> None:
    """A worker's side: serve every socket that arrives on ``line`` with ``here``, until
    the policy process closes it."""
    loop = asyncio.get_running_loop()
    line.setblocking(False)

    def readable() -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(line, 16, 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                log.warning("the connection line from the policy process failed: %s", e)
                msg, fds = b"", []
            if not msg and not fds:  # the policy process closed it
                loop.remove_reader(line.fileno())
                return
            for fd in fds:
                here.serve(socket.socket(fileno=fd))

    loop.add_reader(line.fileno(), readable)
