"""The channel between gateway workers and the policy process: framed msgpack messages
over a local stream socket.

A frame is a 4-byte big-endian length and a msgpack map with an ``op`` key. The worker
side (``WorkerLink``) sends requests with an ``id`` and awaits the answer with the same
id; the policy process answers on the same connection (``mori.gateway.worker_pool``).

The messages (``W>`` from a worker, ``P>`` from the policy process):

- ``W> hello {worker}`` / ``P> hello {gpu_tokens}``: once, first.
- ``W> admit {id, pid, tokens, anon, facts}``: a request arrived; ``P> go {id, replica,
  reloaded, priority}`` once the policy forwards it and the replica's earlier KV controls
  have run, or ``P> reject {id, status, message, retry_after}``.
- ``W> abandon {id}``: the client left before ``go`` (or just as it came).
- ``W> kv_ready {id}``, ``W> failed {id, message, unhealthy}``, ``W> finish {id,
  context, step}``: the lease's events (``mori.gateway.lease``); ``facts`` and ``step`` are ``mori.gateway.agents``'s
  ``RequestFacts`` and ``StepFacts`` as dicts.
- ``W> counts {...}``: the worker's metric increments since its last report.
- ``W> models {id}`` / ``P> models {id, models}``: the engines' served models, asked
  again (a request named a model the worker's list lacks); the policy process also sends
  ``P> models {models}`` (``id`` -1) whenever its list changes, and ``hello`` carries it.
  The list is the policy process's: workers never ask the engines themselves.

A frame may hold a request's text (``facts``, with ``--record-text``), so the largest one
follows the gateway's ``max_body_bytes`` (``frame_limit``); a frame beyond it is refused
where it is written (``FrameTooLarge``), so the link itself never breaks on one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import Callable
from typing import Any

import msgspec

_LEN = struct.Struct(">I")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(dict).decode
MAX_FRAME = 64 * 1024 * 1024
"""The least frame limit (``frame_limit``)."""
FRAME_SLACK = 1024 * 1024
"""Room in a frame beyond the request text it may carry: ids, counts, the map's keys."""


def frame_limit(max_body_bytes: int) -> int:
    """The largest frame of a gateway whose request bodies are at most ``max_body_bytes``:
    a request's text (no longer than its JSON body) and ``FRAME_SLACK``, at least
    ``MAX_FRAME``; both ends of a link use the same settings, so the same limit."""
    return max(MAX_FRAME, max_body_bytes + FRAME_SLACK)


class FrameTooLarge(ValueError):
    """A message larger than the link's frame limit: refused before it is written."""


def frame(msg: dict[str, Any], limit: int = MAX_FRAME) -> bytes:
    data = _encode(msg)
    if len(data) > limit:
        raise FrameTooLarge(f"an IPC message of {len(data)} bytes exceeds the link's limit "
                            f"of {limit} bytes")
    return _LEN.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader,
                     limit: int = MAX_FRAME) -> dict[str, Any] | None:
    """The next message, None at the end of the stream; ``ValueError`` for a frame over
    ``limit`` bytes (the peer is not a gateway process of the same settings)."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ValueError(f"an IPC frame of {n} bytes exceeds the limit of {limit} bytes")
    try:
        data = await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        return None
    msg: dict[str, Any] = _decode(data)
    return msg


class FrameWriter:
    """Writes frames to a stream, the frames of one turn of the event loop together (one
    system call for many messages under load); ``FrameTooLarge`` for a message over
    ``limit`` (nothing written)."""

    __slots__ = ("writer", "limit", "_buf", "_scheduled", "_loop")

    def __init__(self, writer: asyncio.StreamWriter, limit: int = MAX_FRAME) -> None:
        self.writer = writer
        self.limit = limit
        self._loop = asyncio.get_running_loop()
        self._buf: list[bytes] = []
        self._scheduled = False

    def write(self, msg: dict[str, Any]) -> None:
        self._buf.append(frame(msg, self.limit))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._buf and not self.writer.is_closing():
            self.writer.write(b"".join(self._buf))
        self._buf.clear()


class LinkClosed(ConnectionError):
    """The policy process went away."""


class WorkerLink:
    """A worker's connection to the policy process: ``call`` awaits an answer, ``send``
    does not."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 limit: int = MAX_FRAME) -> None:
        self.reader = reader
        self.writer = writer
        self.limit = limit
        self._out = FrameWriter(writer, limit)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pump: asyncio.Task[None] | None = None
        self.closed = False
        self.on_message: Callable[[dict[str, Any]], None] | None = None
        """Called with each message that answers no call (the policy process's own)."""

    @classmethod
    async def connect(cls, path: str, limit: int = MAX_FRAME) -> WorkerLink:
        """A link to the policy process's hub at ``path``, frames up to ``limit`` bytes
        (``frame_limit`` of the gateway's settings)."""
        reader, writer = await asyncio.open_unix_connection(path)
        link = cls(reader, writer, limit)
        link._pump = asyncio.create_task(link._read_loop())
        return link

    def next_id(self) -> int:
        return next(self._ids)

    def send(self, msg: dict[str, Any]) -> None:
        """Queue ``msg``; ``LinkClosed`` once the policy process is gone, ``FrameTooLarge``
        for a message over the frame limit (the link goes on)."""
        if self.closed:
            raise LinkClosed("the policy process is gone")
        self._out.write(msg)

    async def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send ``msg`` (with a fresh ``id`` unless it has one) and await its answer."""
        rid = msg.setdefault("id", self.next_id())
        fut: asyncio.Future[dict[str, Any]] = self._out._loop.create_future()
        self._waiting[rid] = fut
        try:
            self.send(msg)
            return await fut
        finally:
            self._waiting.pop(rid, None)

    async def _read_loop(self) -> None:
        try:
            while (msg := await read_frame(self.reader, self.limit)) is not None:
                fut = self._waiting.get(msg.get("id", -1))
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                elif fut is None and self.on_message is not None:
                    try:
                        self.on_message(msg)
                    except Exception:  # a bad message must not end the link
                        logging.getLogger("mori.gateway").exception(
                            "a message from the policy process failed: %r", msg)
        finally:
            self.closed = True
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(LinkClosed("the policy process is gone"))

    async def close(self) -> None:
        self.closed = True
        self.writer.close()
        if self._pump is not None:
            self._pump.cancel()
