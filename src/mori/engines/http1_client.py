"""A lean HTTP/1.1 client for the forward path: keep-alive connections to one engine.

Every completion the gateway serves is one request to an engine, so the per-request cost
of the client is the gateway's overhead. This client does only what that path needs: a
POST with a complete body, a response read whole or passed through as it arrives, a pool
of keep-alive connections per engine, and the three failures a gateway must tell apart
(refused, timed out, broken), plus one bound: an answer read whole is cut off past a
size limit (``TooLargeError``). Parsing is ``httptools`` (the C parser uvicorn uses);
chunked transfer coding is decoded by it. Control-plane calls (health, metrics, KV
controls) stay on aiohttp, where convenience matters more than microseconds.

A pooled connection the engine has closed while idle is detected before reuse when the
close has arrived; when it arrives only as the request is written (no byte of an answer
read yet), the request is sent once more on a new connection.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

__all__ = ["H1Pool", "H1Response", "RefusedError", "BrokenError", "ReadTimeout",
           "TooLargeError"]

_HIGH_WATER = 1 << 20  # bytes buffered before the connection stops reading
_MAX_HEAD = 1 << 20  # bytes an answer's head may take before the engine counts as broken
# The per-request path keeps the event loop it runs on instead of asking
# ``asyncio.get_running_loop()`` for it: on Python 3.11 that call checks the process id
# with a getpid system call each time (several a request, ~6% of the gateway's CPU
# time under py-spy at one connection).


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


async def _within(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None],
                  seconds: float | None) -> None:
    """Await ``fut``; ``TimeoutError`` after ``seconds`` (None: no limit). One timer
    handle, cheaper on this per-request path than ``asyncio.timeout``."""
    if seconds is None:
        await fut
        return
    timer = loop.call_later(seconds, _expire, fut)
    try:
        await fut
    finally:
        timer.cancel()


class RefusedError(ConnectionError):
    """The engine could not be connected to (refused, unreachable, connect timed out)."""


class BrokenError(ConnectionError):
    """The connection failed or the engine broke the protocol after the request was sent."""


class ReadTimeout(TimeoutError):
    """The engine sent nothing for longer than the read timeout."""


class TooLargeError(BrokenError):
    """An answer read whole (``H1Response.read(limit)``) was over ``limit`` bytes, as its
    ``Content-Length`` declared or as its bytes arrived: the connection was dropped, so
    the engine sees the client leave and aborts the request."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class AbortedError(BrokenError):
    """The gateway gave up on the engine (``H1Pool.abort``): every request in flight
    there ends with this."""


class H1Response:
    """One answer: ``status`` and ``headers`` (lower-case names) once the head arrived;
    the body through ``read()`` or ``chunks()``. ``release()`` returns a fully read
    connection to the pool (or closes one that is not); ``close()`` drops it."""

    __slots__ = ("_conn", "_buf", "_buffered", "_waiter", "_done", "_error", "status",
                 "headers", "_read_timeout", "_released", "_received", "_limit")

    def __init__(self, conn: _Conn, read_timeout: float | None) -> None:
        self._conn = conn
        self._buf: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: BaseException | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self._read_timeout = read_timeout
        self._released = False
        self._received = 0  # body bytes fed so far
        self._limit: int | None = None  # set by read(limit): more bytes end the answer

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    @property
    def at_eof(self) -> bool:
        return self._done and not self._buf

    # -- fed by the connection --------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._received += len(data)
        if self._limit is not None and self._received > self._limit:
            self._over(f"over {self._limit} bytes arrived")
            return
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._done:
            self._error = exc
            self._done = True
        self._wake()

    def _over(self, why: str) -> None:
        """Past the limit: what is buffered goes, the connection is dropped (the engine
        aborts) and the reader gets ``TooLargeError``."""
        assert self._limit is not None
        self._buf.clear()
        self._buffered = 0
        self._released = True  # never back to the pool
        self._error = TooLargeError(f"the answer is over the limit of {self._limit} bytes: "
                                    f"{why}", self._limit)
        self._done = True  # even if the whole answer was in: it is not passed on
        self._conn._broken(self._error)  # wakes the reader; the engine sees the close

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = w = self._conn.loop.create_future()
        try:
            await _within(self._conn.loop, w, self._read_timeout)
        except TimeoutError:
            self.close()
            raise ReadTimeout(f"no data for {self._read_timeout:g} s") from None
        finally:
            self._waiter = None

    # -- read by the caller ---------------------------------------------------------
    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (chunked coding removed)."""
        while True:
            while self._buf:
                data = self._buf.popleft()
                self._buffered -= len(data)
                if self._buffered <= _HIGH_WATER // 2:
                    self._conn.resume()
                yield data
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body. With ``limit``: ``TooLargeError`` (the connection dropped) as
        soon as the answer is known to be longer, from its ``Content-Length`` or from the
        bytes that came. Once it is called, at most ``limit`` bytes and one more read of
        the socket are held (before, what came waits in the buffer, which stops the
        connection reading at 1 MiB)."""
        if limit is not None:
            self._limit = limit
            declared = self.headers.get("content-length", "").strip()
            if declared.isdigit() and int(declared) > limit:
                self._over(f"its Content-Length is {declared}")
            elif self._received > limit:  # arrived before the limit was known
                self._over(f"over {limit} bytes arrived")
        if self._done and self._error is None:  # all here already (the usual small answer)
            data = b"".join(self._buf)
            self._buf.clear()
            self._buffered = 0
            self._conn.resume()
            return data
        parts = [c async for c in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with this answer: a connection read to the end goes back to the pool."""
        if self._released:
            return
        self._released = True
        if self._done and self._error is None and not self._buf:
            self._conn.recycle()
        else:
            self._conn.drop()

    def close(self) -> None:
        """Drop the connection now (the engine sees the client leave and aborts)."""
        if not self._released:
            self._released = True
            self._conn.drop()


class _Conn(asyncio.Protocol):
    """One keep-alive connection; it carries one request at a time."""

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: H1Response | None = None
        self.head: asyncio.Future[None] | None = None
        self.closed = False
        self.got_bytes = False
        self.paused = False
        self.keep_alive = False
        self.eof_body = False  # the answer's body has no length: it ends at EOF
        self.interim = False  # inside a 1xx interim answer (skipped)
        self.head_bytes = 0
        self._header_names: list[bytes] = []
        self._header_values: list[bytes] = []

    # -- asyncio.Protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            self._broken(BrokenError(f"the engine broke HTTP/1.1: {e.__context__ or e}"))
            return
        except httptools.HttpParserError as e:
            self._broken(BrokenError(f"the engine broke HTTP/1.1: {e}"))
            return
        except httptools.HttpParserUpgrade:
            self._broken(BrokenError("the engine asked for a protocol upgrade"))
            return
        head = self.head
        if head is not None and not head.done():
            self.head_bytes += len(data)
            if self.head_bytes > _MAX_HEAD:
                self._broken(BrokenError(f"the answer's head is over {_MAX_HEAD} bytes"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        resp = self.resp
        if resp is not None and not resp._done:
            if self.eof_body and exc is None:
                resp._finish()  # a body without a length ends when the connection does
            else:
                resp._fail(BrokenError(f"the engine closed the connection mid-answer"
                                       f"{f': {exc}' if exc else ''}"))
        head = self.head
        if head is not None and not head.done():
            head.set_exception(BrokenError(f"the engine closed the connection"
                                           f"{f': {exc}' if exc else ''}"))

    # -- httptools callbacks ------------------------------------------------------------
    def on_message_begin(self) -> None:
        resp = self.resp
        if resp is None or resp._done:  # raised through feed_data: the connection is dropped
            raise BrokenError("the engine sent an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_names.append(name)
        self._header_values.append(value)

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim (100 Continue, 103): skipped
            self.interim = True
            self._header_names.clear()
            self._header_values.clear()
            return
        resp.status = status
        self.keep_alive = self.parser.should_keep_alive()  # valid now, not after the body
        resp.headers = {n.decode("latin-1").lower(): v.decode("latin-1")
                        for n, v in zip(self._header_names, self._header_values, strict=True)}
        self._header_names.clear()
        self._header_values.clear()
        te = resp.headers.get("transfer-encoding", "").rpartition(",")[2].strip().lower()
        self.eof_body = not (status in (204, 304) or te == "chunked"
                             or "content-length" in resp.headers)
        head = self.head
        if head is not None and not head.done():
            head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
        elif self.resp is not None:
            self.resp._finish()

    # -- use ----------------------------------------------------------------------------
    def _broken(self, exc: BaseException) -> None:
        if self.resp is not None:
            self.resp._fail(exc)
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self.drop()

    def send(self, data: bytes, resp: H1Response) -> asyncio.Future[None]:
        self.resp = resp
        self.got_bytes = False
        self.keep_alive = False
        self.eof_body = False
        self.head_bytes = 0
        self.head = self.loop.create_future()
        assert self.transport is not None
        self.transport.write(data)
        return self.head

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def recycle(self) -> None:
        if self.closed or not self.keep_alive or len(self.pool._idle) >= self.pool.max_idle:
            self.drop()
            return
        self.resp = None
        self.head = None
        self.resume()
        self.pool._idle.append(self)

    def drop(self) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:  # a reader still waiting (pool closed) must not hang
            resp._fail(BrokenError("the connection was closed"))
        if not self.closed and self.transport is not None:
            self.closed = True
            self.transport.close()
        self.pool._forget(self)


class H1Pool:
    """Keep-alive connections to one ``http://host:port`` (or ``https://``) engine.

    ``connect_timeout``: seconds to open a connection; ``read_timeout``: the longest gap
    between two reads of an answer (None: no limit); ``head_timeout``: the longest wait
    for an answer's head, from the request sent (None: ``read_timeout``); ``max_idle``:
    idle connections kept.
    """

    def __init__(self, url: str, *, connect_timeout: float, read_timeout: float | None,
                 max_idle: int = 1024, head_timeout: float | None = None) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"an engine URL is http:// or https:// (got {url!r})")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.tls = ssl.create_default_context() if u.scheme == "https" else None
        self.prefix = u.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6 in brackets
        self.host_header = (host if u.port is None else f"{host}:{u.port}").encode("idna")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.head_timeout = head_timeout if head_timeout is not None else read_timeout
        self.max_idle = max_idle
        self._idle: collections.deque[_Conn] = collections.deque()
        self._all: set[_Conn] = set()

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self), self.host, self.port, ssl=self.tls,
                    server_hostname=self.host if self.tls is not None else None)
        except TimeoutError:
            raise RefusedError(f"connecting took over {self.connect_timeout:g} s") from None
        except OSError as e:
            raise RefusedError(e.strerror or str(e)) from e
        self._all.add(conn)
        return conn

    def _take_idle(self) -> _Conn | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.transport is not None \
                    and not conn.transport.is_closing():
                return conn
            self._all.discard(conn)
        return None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> H1Response:
        """Send ``POST path`` and wait for the answer's head. Raises ``RefusedError``,
        ``BrokenError`` or ``ReadTimeout``."""
        head = [b"POST ", (self.prefix + path).encode(), b" HTTP/1.1\r\nhost: ",
                self.host_header, b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers.items():
            head += [k.encode("latin-1"), b": ", v.encode("latin-1"), b"\r\n"]
        data = b"".join(head) + b"\r\n" + body
        for attempt in (0, 1):
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            resp = H1Response(conn, self.read_timeout)
            head_ready = conn.send(data, resp)
            try:
                await _within(conn.loop, head_ready, self.head_timeout)
            except TimeoutError:
                conn.drop()
                raise ReadTimeout(f"no answer for {self.head_timeout:g} s") from None
            except AbortedError:
                raise  # given up on (abort): no second try
            except BrokenError:
                conn.drop()
                if reused and not conn.got_bytes and attempt == 0:
                    continue  # the engine had closed the idle connection: once more
                raise
            except BaseException:
                conn.drop()  # cancelled: the engine sees the client leave
                raise
            return resp
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for conn in list(self._all):
            conn.drop()
        self._idle.clear()

    def abort(self, reason: str) -> int:
        """End every request in flight with ``AbortedError(reason)`` and drop every
        connection (the pool stays usable: later requests connect again). Returns how
        many requests were in flight."""
        n = 0
        for conn in list(self._all):
            if conn.resp is not None and not conn.resp._done:
                n += 1
            conn._broken(AbortedError(reason))  # the head's waiter too, then dropped
        self._idle.clear()
        return n
