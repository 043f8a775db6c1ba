"""The Starlette responses both MORI servers send: OpenAI-style errors, and SSE streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Mapping

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from mori.protocol.apis import ApiSpec, anthropic_error_body
from mori.protocol.errors import RequestError, error_body


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
    Messages paths, OpenAI's otherwise (``spec`` None: OpenAI's)."""
    if spec is None or not spec.anthropic:
        return error_response(status, message, param, code, retry_after_s, type_=type_)
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return Response(json.dumps(anthropic_error_body(status, message)), status_code=status,
                    media_type="application/json", headers=headers)


def request_error_response(spec: ApiSpec | None, e: RequestError) -> Response:
    """``e`` as an answer in ``spec``'s API's shape."""
    return api_error_response(spec, e.status, e.message, e.param, e.code, type_=e.type)


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
    ``finally`` must run). ``headers`` default the content type to ``text/event-stream``.

    ``write_timeout_s``: the longest one write may wait for a client that stopped
    reading (the server's flow control holds ``send`` while the socket is full); beyond
    it the stream is cut off (the generator closed, ``on_write_timeout`` called) and the
    server closes the connection. None: no limit.
    """

    def __init__(self, status: int, headers: Mapping[str, str],
                 chunks: AsyncGenerator[bytes, None], *, write_timeout_s: float | None = None,
                 on_write_timeout: Callable[[], None] | None = None) -> None:
        self.status_code = status
        self.chunks = chunks
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
            async for chunk in self.chunks:
                await self._send(send, {"type": "http.response.body", "body": chunk,
                                        "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"",
                                    "more_body": False})
        except _WriteTimeout:
            if self.on_write_timeout is not None:
                self.on_write_timeout()
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


class _WriteTimeout(Exception):
    """A write to the client did not complete within ``EventStream.write_timeout_s``."""
