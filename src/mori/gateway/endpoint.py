"""The completion endpoints as a bare ASGI handler: the gateway's per-request path.

Every completion passes here, so this path skips what the rest of the app gets from
Starlette (routing, middleware, request objects): ``GatewayApp`` hands ``POST`` to the
two completion paths straight to ``CompletionEndpoint``. It checks the caller's key
(``mori.gateway.auth``), reads the body within ``max_body_bytes``, parses it
(``mori.gateway.parsing``), maps the program id into the caller's namespace and serves it
(``mori.gateway.proxy``), while watching for the client to leave: a client that
disconnects before its answer starts has its request cancelled (held: it stays held in
the policy and, forwarded with nobody waiting, ends without reaching the engine; running
upstream: the engine's request is aborted). Streams watch their client themselves
(``EventStream``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from mori.gateway.auth import Access
from mori.gateway.parsing import CHAT, COMPLETIONS, parse_request
from mori.gateway.proxy import serve_completion
from mori.protocol.errors import RequestError
from mori.protocol.responses import error_response

if TYPE_CHECKING:
    from mori.gateway.serving import Serving as Gateway

FAST_PATHS = frozenset((CHAT, COMPLETIONS))
WATCH_AFTER_S = 0.05
"""How long a request runs before the gateway starts watching for its client to leave."""
_WANTED = frozenset((b"authorization", b"content-length", b"x-program-id"))


class ClientGone(Exception):
    """The client disconnected before its request was answered."""


def unauthorized(message: str = "a valid API key is required: send 'Authorization: Bearer "
                 "KEY'") -> Response:
    resp = error_response(401, message, None, "invalid_api_key")
    resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


class CompletionEndpoint:
    """``POST /v1/chat/completions`` and ``POST /v1/completions`` (an ASGI app)."""

    __slots__ = ("gw", "_counters", "_loop")

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._counters: dict[tuple[str, int], Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def _count(self, path: str, status: int) -> None:
        c = self._counters.get((path, status))
        if c is None:
            c = self._counters[(path, status)] = self.gw.metrics.requests.labels(
                path, str(status))
        c.inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gw
        path: str = scope["path"]
        headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in _WANTED}
        principal = gw.keys.identify(headers.get(b"authorization"))
        if principal.access is Access.NONE:
            self._count(path, 401)
            await unauthorized()(scope, receive, send)
            return
        s = gw.settings
        try:
            raw = await read_body(receive, headers.get(b"content-length"), s.max_body_bytes)
            req = parse_request(path, raw, headers.get(b"x-program-id"),
                                principal.id_limit(s.max_program_id_bytes))
        except RequestError as e:
            self._count(path, e.status)
            await e.response()(scope, receive, send)
            return
        except ClientGone:
            self._count(path, 499)
            return
        anonymous = req.program_id is None
        req.program_id = principal.internal(req.program_id or gw.anonymous_id())
        loop = self._loop
        if loop is None:  # kept: get_running_loop makes a system call (mori.engines.h1)
            loop = self._loop = asyncio.get_running_loop()
        resp = await unless_client_leaves(receive, serve_completion(gw, req, anonymous), loop)
        if resp is None:  # the client left: nobody to answer
            self._count(path, 499)
            return
        self._count(path, resp.status_code)
        await resp(scope, receive, send)


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The whole request body; ``RequestError`` 413 beyond ``limit`` bytes, ``ClientGone``
    if the client disconnects first."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the request body ({declared} bytes) exceeds the gateway's "
                           f"limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            raise ClientGone
        body: bytes = msg.get("body", b"")
        size += len(body)
        if size > limit:
            raise RequestError(413, f"the request body exceeds the gateway's limit of "
                               f"{limit} bytes")
        chunks.append(body)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def unless_client_leaves(receive: Receive, work: Coroutine[Any, Any, Response],
                               loop: asyncio.AbstractEventLoop | None = None
                               ) -> Response | None:
    """``work``'s answer, or None if the client disconnects first (its body is read, so
    the next message is the disconnect): ``work``, run in this task, is cancelled then
    where it waits. If this handler is cancelled otherwise (the server stops), the
    cancellation goes on.

    The watch starts ``WATCH_AFTER_S`` after the work does: most answers that come at
    once (a trivial upstream, an error) are sent before, and skip the task it takes. A
    client that left in that time is seen when it starts (its disconnect is kept)."""
    if loop is None:
        loop = asyncio.get_running_loop()
    me = asyncio.current_task(loop)
    assert me is not None
    gone = False
    watch: asyncio.Future[Message] | None = None

    def on_message(w: asyncio.Future[Message]) -> None:
        nonlocal gone
        if not w.cancelled() and w.exception() is None \
                and w.result().get("type") == "http.disconnect":
            gone = True
            me.cancel()

    def start_watch() -> None:
        nonlocal watch
        waiting = receive()
        watch = (loop.create_task(waiting) if asyncio.iscoroutine(waiting)
                 else asyncio.ensure_future(waiting, loop=loop))
        watch.add_done_callback(on_message)

    timer = loop.call_later(WATCH_AFTER_S, start_watch)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone or me.cancelling() > 1:
            raise  # cancelled by someone else as well
        me.uncancel()
        return None
    finally:
        timer.cancel()
        if watch is not None:
            watch.remove_done_callback(on_message)
            if not watch.done():
                watch.cancel()


class GatewayApp(Starlette):
    """The Starlette app, with ``POST`` to the completion paths served by ``endpoint``
    before any routing or middleware (the same endpoint is also routed, for methods)."""

    def __init__(self, endpoint: CompletionEndpoint, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.endpoint = endpoint

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"] in FAST_PATHS:
            await self.endpoint(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
