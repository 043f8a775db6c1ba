"""The Starlette responses both MORI servers send: OpenAI-style errors, and SSE streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mori.protocol.errors import error_body


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


class EventStream(Response):
    """An SSE response sent chunk by chunk; a client that goes away cancels it.

    Lighter than Starlette's ``StreamingResponse`` (no task group per request): one task
    pumps the chunks, the handler's own task watches for the disconnect. The generator is
    always closed, so its ``finally`` runs whether the stream ended or was cut off.
    ``headers`` default the content type to ``text/event-stream``.
    """

    def __init__(self, status: int, headers: Mapping[str, str],
                 chunks: AsyncGenerator[bytes, None]) -> None:
        self.status_code = status
        self.chunks = chunks
        self.background = None
        hdrs = {k.lower(): v for k, v in headers.items()}
        hdrs.setdefault("content-type", "text/event-stream")
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
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

    async def _pump(self, send: Send) -> None:
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()
