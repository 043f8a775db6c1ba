"""The Starlette responses both MORI servers send: errors in each API's JSON shape (for
every route, unknown ones and failures included: ``JSON_ERROR_HANDLERS``), and SSE
streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ExceptionHandler, Message, Receive, Scope, Send

from mori.protocol.apis import API_BY_PATH, GEMINI_APIS, ApiSpec, api_error_body, api_for_path
from mori.protocol.errors import RequestError, clip, error_body
from mori.protocol.fields import MESSAGES
from mori.protocol.gemini.routes import GENERATE, gemini_route


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, retry_after_s: float | None = None, *,
                   type_: str | None = None) -> Response:
    """An error answer (``mori.protocol.errors.error_body``); ``retry_after_s`` adds a
    ``Retry-After`` header (whole seconds, at least 1)."""
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return Response(json.dumps(error_body(status, message, param, code, type_=type_)),
                    status_code=status, media_type="application/json", headers=headers)


def api_error_response(spec: ApiSpec | None, status: int, message: str,
                       param: str | None = None, code: str | None = None,
                       retry_after_s: float | None = None, *, type_: str | None = None
                       ) -> Response:
    """An error answer in the shape of the API a request came in on: Anthropic's for the
    Messages paths, the Gemini API's for its paths (``retry_after_s`` also as a
    ``RetryInfo`` detail), OpenAI's otherwise (``spec`` None: OpenAI's)."""
    if spec is None or not (spec.anthropic or spec.gemini):
        return error_response(status, message, param, code, retry_after_s, type_=type_)
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return Response(json.dumps(api_error_body(spec, status, message, code, retry_after_s)),
                    status_code=status, media_type="application/json", headers=headers)


def request_error_response(spec: ApiSpec | None, e: RequestError) -> Response:
    """``e`` as an answer in ``spec``'s API's shape."""
    return api_error_response(spec, e.status, e.message, e.param, e.code, type_=e.type)


def spec_for_path(path: str) -> ApiSpec | None:
    """The API whose error shape an answer on ``path`` takes: the path's own, Anthropic's
    for any path under ``/v1/messages``, the Gemini API's for any of its model methods
    (one it does not serve included), else None (OpenAI's)."""
    spec = api_for_path(path)
    if spec is None and path.startswith(MESSAGES + "/"):
        spec = API_BY_PATH[MESSAGES]
    if spec is None and gemini_route(path) is not None:
        spec = GEMINI_APIS[GENERATE]
    return spec


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (an unknown path: 404; a method a route does not take:
    405, with ``Allow``) in the API's JSON shape, not as plain text."""
    assert isinstance(exc, HTTPException)
    status, path = exc.status_code, request.url.path
    if status == 404:
        message = f"no such endpoint: {request.method} {clip(path)}"
    elif status == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {clip(path)}" + (
            f" (allowed: {allowed})" if allowed else "")
    else:
        message = exc.detail
    resp = api_error_response(spec_for_path(path), status, message, None,
                              _HTTP_CODES.get(status),
                              type_="invalid_request_error" if status < 500 else None)
    for k, v in (exc.headers or {}).items():
        resp.headers[k] = v
    return resp


async def _server_error(request: Request, exc: Exception) -> Response:
    """A handler that failed: a 500 in the API's JSON shape (the server logs the
    traceback)."""
    return api_error_response(spec_for_path(request.url.path), 500,
                              "the server failed to answer (an internal error: see its log)",
                              None, "internal_error", type_="api_error")


JSON_ERROR_HANDLERS: Mapping[Any, ExceptionHandler] = {HTTPException: _http_error,
                                                       Exception: _server_error}
"""Starlette ``exception_handlers`` that make every error a JSON one in the API's shape
(``spec_for_path``): unknown paths (404), wrong methods (405), failed handlers (500)."""


async def send_server_error(scope: Scope, receive: Receive, send: Send) -> bool:
    """Answer 500 in the API's JSON shape for a bare ASGI handler that failed; False if
    its answer had started already (the server closes the connection then)."""
    resp = api_error_response(spec_for_path(scope.get("path", "")), 500,
                              "the server failed to answer (an internal error: see its log)",
                              None, "internal_error", type_="api_error")
    try:
        await resp(scope, receive, send)
    except RuntimeError:  # the server refuses a second start
        return False
    return True


def transport_of(send: Send) -> Any:
    """The transport of the connection ``send`` writes to, where the server lets it be
    found (uvicorn's ``send`` is a method of its request cycle, which holds it; a wrapper
    may carry its own ``transport``); None otherwise."""
    owner = getattr(send, "__self__", send)
    return getattr(owner, "transport", None)


class PassThrough(Response):
    """A complete answer passed on as the engine gave it: ``headers`` (lower-case names)
    are sent as they are, with the body's length; nothing is re-derived. ``after`` is
    called once the answer is handed to the server (or sending it failed), in the same
    task and before it yields: bookkeeping that need not delay the client's bytes."""

    def __init__(self, status: int, body: bytes, headers: Mapping[str, str],
                 after: Callable[[], None] | None = None) -> None:
        self.status_code = status
        self.body = body
        self.background = None
        self.after = after
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
               if k != "content-length"]
        raw.append((b"content-length", str(len(body)).encode("latin-1")))
        self.raw_headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body})
        finally:
            if self.after is not None:
                self.after()


class EventStream(Response):
    """An SSE response sent chunk by chunk; a client that goes away cancels it.

    Lighter than Starlette's ``StreamingResponse`` (no task group per request): one task
    pumps the chunks, the handler's own task watches for the disconnect. The generator is
    always closed, so its ``finally`` runs whether the stream ended or was cut off (a
    generator that never started runs none of its body: start it before, if its
    ``finally`` must run). ``headers`` default the content type to ``text/event-stream``;
    ``first``: bytes already taken from the generator (the caller looked ahead), sent
    before it.

    ``write_timeout_s``: the longest one write may wait for a client that stopped
    reading (the server's flow control holds ``send`` while the socket is full); beyond
    it the stream is cut off (the generator closed, ``on_write_timeout`` called) and its
    connection closed at once, so the server sees a client gone, not a response left
    unfinished (``_cut_off``). None: no limit.
    """

    def __init__(self, status: int, headers: Mapping[str, str],
                 chunks: AsyncGenerator[bytes, None], *, first: bytes = b"",
                 write_timeout_s: float | None = None,
                 on_write_timeout: Callable[[], None] | None = None) -> None:
        self.status_code = status
        self.chunks = chunks
        self.first = first
        self.write_timeout_s = write_timeout_s
        self.on_write_timeout = on_write_timeout
        self.background = None
        hdrs = {k.lower(): v for k, v in headers.items()}
        hdrs.setdefault("content-type", "text/event-stream")
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        try:
            while not pump.done():
                watch = asyncio.ensure_future(receive())
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not watch.done():
                    watch.cancel()
                    break
                if watch.result().get("type") == "http.disconnect":
                    pump.cancel()
                    break
        finally:
            if not pump.done():
                pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            await self.chunks.aclose()  # a no-op unless the pump was cancelled unstarted

    async def _pump(self, send: Send) -> None:
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            if self.first:
                await self._send(send, {"type": "http.response.body", "body": self.first,
                                        "more_body": True})
            async for chunk in self.chunks:
                await self._send(send, {"type": "http.response.body", "body": chunk,
                                        "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"",
                                    "more_body": False})
        except _WriteTimeout:
            if self.on_write_timeout is not None:
                self.on_write_timeout()
            await _cut_off(send)
        finally:
            await self.chunks.aclose()

    async def _send(self, send: Send, message: Message) -> None:
        if self.write_timeout_s is None:
            await send(message)
            return
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await send(message)
        except TimeoutError:
            raise _WriteTimeout from None


async def _cut_off(send: Send) -> None:
    """End a response whose client stopped reading: its connection is aborted (what
    waits in the buffers is dropped), then the response ended, which the server, having
    seen the connection go, takes as sent to a client that left (uvicorn would otherwise
    log that the app returned without completing its response, and close the connection
    itself). Where the connection's transport cannot be found, the server does that."""
    abort = getattr(transport_of(send), "abort", None)
    if not callable(abort):
        return
    abort()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):  # the server's flow control lets go once it sees
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class _WriteTimeout(Exception):
    """A write to the client did not complete within ``EventStream.write_timeout_s``."""
