"""Bounds on every connection the gateway serves: the request head's size and time, the
body's size and pace, the idle keep-alive, and how many connections a process holds.

uvicorn (its httptools protocol, which the gateway serves with) bounds only the idle
keep-alive (``timeout_keep_alive``; its slower h11 protocol also bounds a head's size). It has no limit on a request head (httptools joins
a header's pieces as they arrive: one huge header costs its size in memory and, joined
piece by piece, stalls the event loop), no time limit on a head or a body, and no cap on
connections (``limit_concurrency`` answers 503 to requests once their heads are read,
and never frees a descriptor). So every gateway process (the policy process and each
``--workers`` worker) serves with ``BoundedHttpToolsProtocol``, a subclass of uvicorn's
``HttpToolsProtocol`` given as ``uvicorn.Config(http=...)`` (the sockets handed over by
``mori.gateway.handoff`` are served with the same class), which adds:

- ``max_header_bytes``: the head (request line and headers) is counted in
  ``data_received`` before the parser sees it; a head not complete within that many
  bytes is answered 431 and the connection closed. (A head that follows a pipelined
  request in the same read is counted from the next read: at most one read more.) A
  chunked body's framing and trailers (joined like headers) are held to the same limit,
  plus 64 bytes a chunk.
- ``header_timeout_s``: a head must be complete this long after its first byte (after
  the connection opened, for its first request): beyond, 408 (nothing at all sent: no
  answer) and the connection closes.
- ``max_body_bytes`` on every route, before the app reads anything: a ``Content-Length``
  over it is answered 413 at once, the body unread; a chunked body is counted as it
  arrives and answered 413 when it passes the limit. (The completion endpoint checks the
  same limit, in its API's error shape, where it is served without these bounds.)
- ``body_timeout_s``: a body (one shorter than its ``Content-Length``, a chunked one that
  never ends) with no byte for that long is answered 408 (if nothing was answered yet:
  the app sees a disconnect) and the connection closes. The time the app itself leaves
  the body unread (uvicorn stops reading past 64 KiB buffered) does not count.
- ``keep_alive_timeout_s``: uvicorn's own keep-alive timer, with this value.
- ``max_connections`` open at once in each process, and never more than the descriptor
  limit (RLIMIT_NOFILE, raised toward its hard limit where that is needed) leaves after
  a reserve for the engines' connections and files (``descriptor_cap``). At the cap a new
  connection closes the longest-idle open one (no request in progress: nothing sent yet,
  or between requests on keep-alive), so idle connections cannot lock clients out; when
  every open connection has a request in progress, the new one is answered 503 with
  ``Retry-After`` and closed. One warning says so when the cap binds (then at most one a
  minute, with counts).

- malformed HTTP (a raw CR or NUL in a header, a bad or duplicated ``Content-Length``,
  ``Content-Length`` with ``Transfer-Encoding``, no HTTP at all, a URL that cannot be
  parsed): answered 400 with what the parser found, and the connection closed, in place
  of uvicorn's plain-text 400.

After a refusal given here (400, 408, 413, 431, 503) nothing more is read: the answer is
sent, the write side shut, reading stopped, and the connection closed ``LINGER_S`` later
(or at once if anything more is read), so what the client still sends waits in the
kernel's buffers, unread, until the close. An app that answers before its request's body
was read whole (401, 404) gets a lingering close: what the client still sends is read and
dropped, at most ``LINGER_BYTES`` of it and for at most ``LINGER_S``, so a client that
sends the rest of a small body reads the answer and a clean end rather than a reset.
(Linux keeps an answer already received readable after a reset.) Every answer given here
is JSON in OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``;
Anthropic's on the Messages paths).
The timeouts are checked by one sweep per process every ``ConnectionGuard.tick`` (a
quarter of the shortest, at most 0.5 s), not by a timer per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from mori.protocol.apis import api_error_body, api_for_path
from mori.protocol.errors import error_body

if TYPE_CHECKING:
    from mori.gateway.config import GatewaySettings

log = logging.getLogger("mori.gateway")

LINGER_S = 2.0
"""After an answer sent before its request's body was read whole: how long until the
connection is closed."""
LINGER_BYTES = 64 * 1024
"""After an app's answer sent before its request's body was read whole: the most of what
the client still sends that is read and dropped (beyond, the connection is closed). None
at all after a refusal."""
LOG_EVERY_S = 60.0
"""The connection cap's warning: at most one this often."""

# a connection's phase
_FRESH = 0  # opened, nothing received yet
_IDLE = 1  # between requests (keep-alive)
_HEAD = 2  # a request head arriving
_BODY = 3  # the head complete, its body arriving
_WAIT = 4  # the request complete, the app answering
_DONE = 5  # answered and lingering, or closing: nothing more is parsed


@dataclass(frozen=True, slots=True)
class ConnectionBounds:
    """The bounds of ``mori.gateway.bounds`` (the gateway's ``GatewaySettings`` names
    them the same, ``max_connections`` per process)."""

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_connections: int = 4096

    @staticmethod
    def of(settings: GatewaySettings) -> ConnectionBounds:
        return ConnectionBounds(settings.max_header_bytes, settings.header_timeout_s,
                                settings.keep_alive_timeout_s, settings.body_timeout_s,
                                settings.max_body_bytes, settings.max_connections)


def _reserve(limit: int) -> int:
    """Descriptors kept back from client connections under a limit of ``limit``: the
    engines' connections (two a request with simulated engines in the process), the
    listeners, logs and files."""
    return max(128, limit // 4)


def descriptor_cap(wanted: int) -> int:
    """How many client connections this process may hold: ``wanted``, or fewer where the
    descriptor limit (RLIMIT_NOFILE) leaves less after ``_reserve``. The soft limit is
    raised first, toward the hard one, as far as ``wanted`` needs."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not a Unix
        return wanted
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover
        return wanted
    inf = resource.RLIM_INFINITY
    need = wanted + max(128, -(-wanted // 3))  # then need - _reserve(need) >= wanted
    if soft != inf and soft < need:
        target = need if hard == inf else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    if soft == inf:
        return wanted
    return max(1, min(wanted, soft - _reserve(soft)))


class _Refused(Exception):
    """Raised in a parser callback to stop parsing: the request is refused."""


class ConnectionGuard:
    """One process's connections, served with ``protocol_class`` (``uvicorn.Config(
    **guard.uvicorn_options())``): the cap on how many are open, and the sweep that
    ends those past their deadline."""

    def __init__(self, bounds: ConnectionBounds) -> None:
        self.bounds = bounds
        self.cap = descriptor_cap(bounds.max_connections)
        if self.cap < bounds.max_connections:
            log.warning("--max-connections %d is more than this process's descriptor limit "
                        "allows; at most %d client connections are held open (raise the "
                        "limit, e.g. ulimit -n, for more)", bounds.max_connections, self.cap)
        self.open: set[BoundedHttpToolsProtocol] = set()
        # no request in progress (fresh or keep-alive), longest idle first
        self.idle: dict[BoundedHttpToolsProtocol, None] = {}
        self.lingering: dict[BoundedHttpToolsProtocol, None] = {}
        self.tick = min(0.5, max(0.02, min(bounds.header_timeout_s, bounds.body_timeout_s,
                                           LINGER_S) / 4))
        self.evicted = 0  # connections closed to make room, and new ones refused: in all
        self.refused = 0
        self._unreported = [0, 0]  # the same, since the last warning
        self._next_log = -math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.protocol_class: type[BoundedHttpToolsProtocol] = type(
            "BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"guard": self})

    def uvicorn_options(self) -> dict[str, Any]:
        """What ``uvicorn.Config`` takes to serve with these bounds (no WebSockets: the
        gateway serves none)."""
        return {"http": self.protocol_class, "ws": "none",
                "timeout_keep_alive": max(1, math.ceil(self.bounds.keep_alive_timeout_s))}

    def admit(self, p: BoundedHttpToolsProtocol) -> bool:
        """Count a new connection; at the cap, close a lingering or the longest-idle open
        one first. False: none could be closed, refuse ``p`` (it is counted meanwhile)."""
        if self._loop is None:
            self._loop = p.loop
        ok = True
        if len(self.open) >= self.cap:
            victim = next(iter(self.lingering), None) or next(iter(self.idle), None)
            if victim is not None:
                self.forget(victim)
                victim.close_now()
                self.evicted += 1
                self._unreported[0] += 1
            else:
                ok = False
                self.refused += 1
                self._unreported[1] += 1
            self._report()
        self.open.add(p)
        if ok:
            self.idle[p] = None
        if self._timer is None:
            self._timer = self._loop.call_later(self.tick, self._sweep)
        return ok

    def forget(self, p: BoundedHttpToolsProtocol) -> None:
        self.open.discard(p)
        self.idle.pop(p, None)
        self.lingering.pop(p, None)

    def _report(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        if now < self._next_log:
            return
        self._next_log = now + LOG_EVERY_S
        closed, refused = self._unreported
        self._unreported = [0, 0]
        log.warning("the connection cap binds: %d connections open in this process "
                    "(--max-connections); the longest-idle are closed to make room, and "
                    "new ones refused with 503 while every open one has a request in "
                    "progress (since the last such line: %d closed, %d refused)",
                    self.cap, closed, refused)

    def _sweep(self) -> None:
        self._timer = None
        assert self._loop is not None
        now = self._loop.time()
        for p in [p for p in self.open if p.deadline <= now]:
            p.expire(now)
        if self.open:
            self._timer = self._loop.call_later(self.tick, self._sweep)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol within a ``ConnectionGuard``'s bounds (the guard is a
    class attribute: ``ConnectionGuard.protocol_class`` is a subclass per guard)."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # uvicorn's keep-alive timer, with fractions of a second allowed
        self.timeout_keep_alive = self.guard.bounds.keep_alive_timeout_s  # type: ignore[assignment]
        self.phase = _FRESH
        self.deadline = math.inf  # when the sweep ends this phase (FRESH, HEAD, BODY, DONE)
        self.head_bytes = 0
        self.body_bytes = 0
        self.wire_bytes = 0  # bytes received while the body arrives (from the next read)
        self.chunks = 0
        self.heads = 0  # heads completed on this connection
        self._refusal: tuple[int, str, str, RequestResponseCycle | None] | None = None
        self.linger_left = 0  # lingering: bytes that may still be read and dropped

    # the connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.deadline = self.loop.time() + self.guard.bounds.header_timeout_s
        if not self.guard.admit(self):
            self._refuse(503, "the gateway has too many open connections; retry later",
                         "too_many_connections", None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        self.phase = _DONE
        self.deadline = math.inf
        super().connection_lost(exc)

    def close_now(self) -> None:
        """Close (the connection cap, a deadline); nothing more is read."""
        self.phase = _DONE
        self.deadline = math.inf
        self.guard.idle.pop(self, None)
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        phase = self.phase
        if phase == _DONE:  # lingering: dropped, within its budget
            self.linger_left -= len(data)
            if self.linger_left < 0:
                self.close_now()
            return
        if phase <= _IDLE:  # a request begins
            self.guard.idle.pop(self, None)
            if phase == _IDLE:
                self.deadline = self.loop.time() + self.guard.bounds.header_timeout_s
            self.phase = _HEAD
            self.head_bytes = 0
        self._unset_keepalive_if_required()
        if self.phase == _HEAD:  # the head counted before the parser keeps any of it
            room = self.guard.bounds.max_header_bytes - self.head_bytes
            if len(data) > room:
                heads = self.heads
                if room > 0:
                    self._feed(data[:room])
                if self.heads != heads:  # the head ended within the limit
                    if self.phase != _DONE:
                        self._feed(data[room:])
                    return
                if self.phase != _DONE:
                    self._refuse(431, "the request head (request line and headers) exceeds "
                                 f"the gateway's limit of {self.guard.bounds.max_header_bytes}"
                                 " bytes", "request_header_fields_too_large", None)
                return
            self.head_bytes += len(data)
        elif self.phase == _BODY:
            self.wire_bytes += len(data)
            self._feed(data)
            # what is not body: chunk sizes and trailers (httptools joins a trailer's
            # pieces like a header's), within a head's limit and a little a chunk
            if self.phase == _BODY and self.wire_bytes - self.body_bytes \
                    > self.guard.bounds.max_header_bytes + 64 * self.chunks:
                self._refuse(431, "the request body's chunk framing and trailers exceed "
                             f"the gateway's limit of {self.guard.bounds.max_header_bytes} "
                             "bytes", "request_header_fields_too_large", self.cycle)
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():  # pragma: no cover - no WebSockets (ws="none")
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as e:
            refusal, self._refusal = self._refusal, None
            if refusal is not None:
                self._refuse(*refusal)
                return
            fault = _parser_fault(e)
            self.logger.warning("Invalid HTTP request received: %s", fault)
            self._refuse(400, f"malformed HTTP request: {fault}; send HTTP/1.1 with "
                         "header values free of control characters and at most one of "
                         "a numeric Content-Length or Transfer-Encoding: chunked",
                         "invalid_http_request", None)

    # the parser's callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.phase >= _BODY:  # pipelined after a complete request: a new head
            self.phase = _HEAD
            self.head_bytes = 0
            self.deadline = self.loop.time() + self.guard.bounds.header_timeout_s

    def on_headers_complete(self) -> None:
        self.heads += 1
        limit = self.guard.bounds.max_body_bytes
        for name, value in self.headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                self._refusal = (413, f"the request body ({int(value)} bytes) exceeds the "
                                 f"gateway's limit of {limit} bytes", "request_too_large", None)
                raise _Refused
        self.phase = _BODY
        self.body_bytes = self.wire_bytes = self.chunks = 0
        self.deadline = self.loop.time() + self.guard.bounds.body_timeout_s
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        limit = self.guard.bounds.max_body_bytes
        if self.body_bytes > limit:
            self._refusal = (413, f"the request body exceeds the gateway's limit of {limit} "
                             "bytes", "request_too_large", self.cycle)
            raise _Refused
        self.deadline = self.loop.time() + self.guard.bounds.body_timeout_s
        super().on_body(body)

    def on_chunk_header(self) -> None:
        self.chunks += 1

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.phase == _BODY:
            self.phase = _WAIT
            self.deadline = math.inf

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if self.phase == _BODY and cycle is not None and cycle.response_complete \
                and not self.pipeline:  # answered before its body was read whole
            self.server_state.total_requests += 1
            self._linger()
            return
        super().on_response_complete()
        if self.phase == _WAIT and cycle is not None and cycle.response_complete \
                and not self.transport.is_closing():
            self.phase = _IDLE
            self.guard.idle[self] = None  # the longest idle first

    # deadlines and refusals

    def expire(self, now: float) -> None:
        """The sweep: this connection's deadline passed."""
        b = self.guard.bounds
        if self.phase == _BODY:
            if self.flow.read_paused:  # the app has not taken what came: not the client
                self.deadline = now + b.body_timeout_s
                return
            self._refuse(408, f"the request body stalled: nothing arrived for "
                         f"{b.body_timeout_s:g} s", "body_timeout", self.cycle)
        elif self.phase == _HEAD:
            self._refuse(408, f"the request head was not complete within "
                         f"{b.header_timeout_s:g} s", "header_timeout", None)
        else:  # fresh, nothing sent; or done lingering
            self.close_now()

    def _refuse(self, status: int, message: str, code: str,
                mine: RequestResponseCycle | None) -> None:
        """Answer ``status`` (a JSON error) and end the connection (a lingering close),
        where an answer can be given: no other request is being answered, and ``mine`` (the refused request's
        cycle, if the app has it) has not started its own answer. Otherwise just close."""
        cycle = self.cycle
        busy = cycle is not None and not cycle.response_complete
        if self.pipeline or (busy and (cycle is not mine or cycle.response_started)) \
                or self.transport.is_closing():
            self.close_now()
            return
        if mine is not None:  # the app reading the body sees a disconnect, answers nothing
            mine.disconnected = True
            mine.message_event.set()
        self.transport.write(self._answer(status, message, code))
        self._linger(0)

    def _linger(self, budget: int = LINGER_BYTES) -> None:
        """End the connection after an answer: shut the write side, read and drop at most
        ``budget`` more bytes (0: stop reading), close at ``LINGER_S``."""
        self.phase = _DONE
        self.deadline = self.loop.time() + LINGER_S
        self.linger_left = budget
        self._unset_keepalive_if_required()
        self.guard.idle.pop(self, None)
        self.guard.lingering[self] = None
        t = self.transport
        if t.is_closing():
            return
        if budget > 0:
            self.flow.resume_reading()  # read what still comes, and drop it
        else:
            self.flow.pause_reading()  # nothing more is read
        if t.can_write_eof():
            try:
                t.write_eof()
                return
            except (OSError, RuntimeError):  # pragma: no cover
                pass
        t.close()

    def _answer(self, status: int, message: str, code: str) -> bytes:
        path = getattr(self, "url", b"").split(b"?", 1)[0].decode("latin-1")
        spec = api_for_path(path)
        if spec is not None and (spec.anthropic or spec.gemini):
            obj = api_error_body(spec, status, message)
        else:
            obj = error_body(status, message, None, code,
                             type_=None if status in (413, 503) else "invalid_request_error")
        body = json.dumps(obj).encode()
        out = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            out += [name, b": ", value, b"\r\n"]
        out.append(b"content-type: application/json\r\ncontent-length: %d\r\n"
                   b"connection: close\r\n" % len(body))
        if status == 503:
            out.append(b"retry-after: 1\r\n")
        out += [b"\r\n", body]
        return b"".join(out)


def _parser_fault(e: httptools.HttpParserError) -> str:
    """What the HTTP parser found wrong (a callback's own error: its cause)."""
    cause = e.__cause__ or e.__context__
    if isinstance(e, httptools.HttpParserCallbackError) and cause is not None:
        e = cause  # type: ignore[assignment]
    text = str(e).strip() or type(e).__name__
    return text[:200]


__all__ = ["LINGER_BYTES", "LINGER_S", "BoundedHttpToolsProtocol", "ConnectionBounds", "ConnectionGuard",
           "descriptor_cap"]
