"""Following a request through the simulated engine, for every API: a stream paced by the
engine (``stream_answer``, the API's bytes from a ``Render``), or the wait for a whole
answer (``wait_answer``); and the SSE framing the APIs share.

A stream sends the API's opening events at once (``Render.head``), the ``: kv-ready``
comment line (``KV_READY_LINE``) when the request's KV is in place, each output token's
events when the engine has produced it (tokens due within ``min_emit_interval_s`` of
each other in one write), then the API's closing events (``Render.tail``). An engine
that aborts the request (shutting down) ends the stream with the API's error event
(``Render.aborted``). Closing the stream early (the client went away) aborts the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from enum import StrEnum
from typing import Any, Protocol

from starlette.types import Receive

from mori.protocol.fields import KV_READY_LINE
from mori.sim.realtime import RealtimeReplica, Track

SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
               "x-accel-buffering": "no"}


def sse_data(data: Any) -> bytes:
    """One unnamed SSE event (``data: JSON``), compact JSON."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def sse_named(event: str, data: Any) -> bytes:
    """One named SSE event (``event: NAME`` then ``data: JSON``), as the Messages and
    Responses APIs send them."""
    return (b"event: " + event.encode() + b"\ndata: "
            + json.dumps(data, separators=(",", ":")).encode() + b"\n\n")


class Render(Protocol):
    """An API's stream bytes for one request."""

    def head(self) -> bytes:
        """Sent as the stream opens (b"": nothing)."""
        ...

    def tokens(self, start: int, stop: int) -> bytes:
        """Output tokens ``start`` to ``stop`` - 1, now produced."""
        ...

    def tail(self) -> bytes:
        """Sent once the answer is complete (its usage is known)."""
        ...

    def aborted(self) -> bytes:
        """The error event for a request the engine aborted."""
        ...


async def stream_answer(engine: RealtimeReplica, track: Track, render: Render
                        ) -> AsyncGenerator[bytes, None]:
    """The SSE chunks of a streaming request, paced by the engine (see the module doc)."""
    min_wait = engine.config.min_emit_interval_s
    sent = 0
    kv_said = False
    try:
        head = render.head()
        if head:
            yield head
        while True:
            track.changed.clear()
            engine.sync()
            if track.aborted:  # by the engine (shutting down): say so
                yield render.aborted()
                return
            if not kv_said and track.kv_ready_at is not None:
                kv_said = True
                yield KV_READY_LINE + b"\n\n"
            due = engine.tokens_done(track)
            if due > sent:
                yield render.tokens(sent, due)
                sent = due
            if track.finished_at is not None:
                break
            nxt = engine.next_token_time(track)
            wait = None if nxt is None else max(engine.wall_delay(nxt), min_wait)
            await engine.wait_change(track, wait)
        yield render.tail()
    finally:
        engine.abort(track)  # no-op once finished


class Outcome(StrEnum):
    """How a non-streaming request ended."""

    FINISHED = "finished"
    CLIENT_GONE = "client_gone"  # the client disconnected: the request was aborted
    ABORTED = "aborted"  # by the engine (shutting down)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _wait_done(track: Track) -> None:
    while not track.done:
        track.changed.clear()
        if track.done:
            return
        await track.changed.wait()


async def wait_answer(engine: RealtimeReplica, track: Track, receive: Receive) -> Outcome:
    """Wait until the request is done, or its client goes away (which aborts it)."""
    done = asyncio.ensure_future(_wait_done(track))
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (done, gone):
            t.cancel()
        await asyncio.gather(done, gone, return_exceptions=True)
        engine.abort(track)  # no-op once finished
    if track.finished_at is not None:
        return Outcome.FINISHED
    if gone.done() and not gone.cancelled():
        return Outcome.CLIENT_GONE
    return Outcome.ABORTED
