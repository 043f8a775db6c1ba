"""The gateway's end of the label channel to the MORI plug-in in one engine (vLLM or
SGLang: ``mori.engines.plugin_link``, which both adapters hold).

The plug-in binds a ZMQ ``ROUTER`` at the label endpoint; ``LabelChannel`` connects a
``DEALER`` and speaks the protocol of ``mori.plugin_channel.protocol``: one JSON frame per
message, one reply per message. One request is outstanding at a time (a lock), so each
reply answers the request just sent.

A reply that does not come within ``timeout_s`` (or a frame that is not a reply to the
request) means the channel is down: the socket is closed and the next request opens a new
one, so nothing sent to an absent plug-in stays queued in the socket and no late reply
can be taken for the answer to a later request. ``LabelChannelDown`` says so;
``LabelRefused`` is a plug-in that answered ``ok: false`` (the channel is up).

The channel keeps the table of labels it has been asked to set (``table``): ``set_label``
records a label, ``drop`` and ``clear`` forget them, ``replace`` sends the table whole.
The table changes even when the send fails, so that it can be re-sent on reconnection.
A table too large for one frame (the engine drops a peer that sends a frame over its
``max_frame_bytes``, from its handshake) goes as a ``replace`` and ``set`` messages, each
under it, sent while no other request can come between them.

With a secret (``mori.plugin_channel.auth``: the same file the engine reads), every
message is signed and every reply must be signed by the engine, bound to its request; a
reply that is not (an engine without the secret, or with another one, or something else
at the endpoint) makes the channel *down*, with a message saying which. Without a secret,
only an endpoint on this machine is accepted (``auth.check_exposure``): an engine refuses
to bind any other without one.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import zmq
import zmq.asyncio

from mori.plugin_channel import protocol
from mori.plugin_channel.auth import LabelSecret, check_exposure, new_nonce

MAX_REPLY_BYTES = 64 << 20  # a larger reply frame drops the connection (ZMQ MAXMSGSIZE)
FRAME_MARGIN = 1024  # bytes of a message besides its labels (v, op, ts, nonce, braces)


class LabelChannelError(Exception):
    """A label-channel request that did not succeed."""


class LabelChannelDown(LabelChannelError):
    """The plug-in did not answer in time, or answered something that is not a reply."""


class LabelRefused(LabelChannelError):
    """The plug-in answered ``ok: false`` (its ``error`` is the message)."""


class LabelChannel:
    """An asyncio DEALER client for one engine's label endpoint."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0, *,
                 secret: LabelSecret | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a label-channel timeout is > 0 s, got {timeout_s}")
        check_exposure(endpoint, secret, side="gateway")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.secret = secret
        self.max_frame_bytes = protocol.MAX_FRAME_BYTES
        """The largest frame the engine takes (its handshake says; the protocol's
        default before)."""
        self.table: dict[str, str] = {}
        """program id -> label, as the gateway last asked for it."""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()
        self.resets = 0  # sockets closed because a reply did not come

    # -- requests ---------------------------------------------------------------------------
    async def hello(self) -> dict[str, Any]:
        """The handshake: the plug-in's reply (``block_size``, ``gpu_blocks``,
        ``cpu_tier_tokens``, ``programs``, ``plugin_version``)."""
        answer = await self._request("hello")
        limit = answer.get("max_frame_bytes")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 4096:
            self.max_frame_bytes = limit
        return answer

    async def residency(self) -> dict[str, Any]:
        """What the engine holds of each program (``gpu`` and ``cpu``: program -> tokens;
        ``inactive``: programs released), as the plug-in answers ``residency``."""
        return await self._request("residency")

    def record(self, program_id: str, label: str) -> None:
        """Put a label in the table without sending it (``LabelRefused`` if the protocol
        would refuse it)."""
        if not 0 < len(program_id) <= protocol.MAX_PROGRAM_ID:
            raise LabelRefused(f"a program id of {len(program_id)} characters: the label "
                               f"channel takes 1 to {protocol.MAX_PROGRAM_ID}")
        if label not in protocol.LABELS:
            raise LabelRefused(f"label {label!r} is not one of {', '.join(protocol.LABELS)}")
        self.table[program_id] = label

    def forget(self, program_id: str) -> None:
        """Take a program out of the table without sending anything."""
        self.table.pop(program_id, None)

    async def set_label(self, program_id: str, label: str) -> None:
        self.record(program_id, label)
        await self._request("set", labels={program_id: label})

    async def set_many(self, labels: Mapping[str, str]) -> None:
        """Set several labels (one message, or several each under the engine's frame
        limit; the engine keeps its others)."""
        for pid, label in labels.items():
            self.record(pid, label)
        async with self._lock:
            for chunk in self._chunks(dict(labels)):
                await self._exchange("set", {"labels": chunk})

    async def drop(self, program_id: str) -> None:
        self.forget(program_id)
        await self._request("drop", program=program_id)

    async def clear(self) -> None:
        self.table.clear()
        await self._request("clear")

    async def replace(self, table: Mapping[str, str] | None = None) -> None:
        """Send the full table (``table`` becomes it when given): the engine forgets the
        labels it had and takes these."""
        if table is not None:
            self.table = dict(table)
        async with self._lock:  # the table as it is when the first message leaves
            for i, chunk in enumerate(self._chunks(dict(self.table))):
                await self._exchange("set" if i else "replace", {"labels": chunk})

    def _chunks(self, labels: dict[str, str]) -> Iterator[dict[str, str]]:
        """``labels`` in pieces whose message stays under ``max_frame_bytes`` (one piece,
        empty, for an empty table)."""
        budget = self.max_frame_bytes - FRAME_MARGIN
        chunk: dict[str, str] = {}
        size = 0
        for pid, label in labels.items():
            n = len(json.dumps(pid)) + len(label) + 4  # "pid":"label",
            if chunk and size + n > budget:
                yield chunk
                chunk, size = {}, 0
            chunk[pid] = label
            size += n
        yield chunk

    async def _request(self, op: str, **fields: Any) -> dict[str, Any]:
        async with self._lock:
            return await self._exchange(op, fields)

    async def _exchange(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        """One request and its reply (the caller holds the lock)."""
        sock = self._socket()
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.secret is None:
                    tag = b""
                    await sock.send(protocol.encode(op, **fields))
                else:
                    frame = protocol.encode(op, **fields, ts=time.time(),
                                            nonce=new_nonce())
                    tag = self.secret.sign_request(frame)
                    await sock.send_multipart([frame, tag])
                parts = await sock.recv_multipart()
            answer = self._verified(parts, tag)
            if answer.get("ok") and answer.get("op") != op:  # a refusal may not know it
                raise protocol.ProtocolError(f"a reply to {answer.get('op')!r}, not {op!r}")
        except TimeoutError:
            self._reset()
            raise LabelChannelDown(f"no answer from the MORI plug-in at {self.endpoint} "
                                   f"within {self.timeout_s:g} s") from None
        except (protocol.ProtocolError, zmq.ZMQError) as e:
            self._reset()
            raise LabelChannelDown(f"label channel {self.endpoint}: {e}") from None
        except BaseException:  # cancelled mid-request: its reply must not be read later
            self._reset()
            raise
        if not answer.get("ok"):
            raise LabelRefused(f"the MORI plug-in at {self.endpoint} refused {op!r}: "
                               f"{answer.get('error', '(no reason given)')}")
        return answer

    def _verified(self, parts: list[bytes], tag: bytes) -> dict[str, Any]:
        """The reply, when it is one to the request signed ``tag`` (``ProtocolError``
        saying why not otherwise)."""
        if self.secret is not None:
            if len(parts) == 2 and self.secret.verify_reply(tag, parts[0], parts[1]):
                return protocol.decode_reply(parts[0])
            answer = protocol.decode_reply(parts[-1])
            if answer.get("op") == protocol.REFUSED:
                raise protocol.ProtocolError(
                    f"the engine refused the gateway's message ({answer.get('error')}): the "
                    f"gateway's label secret ({self.secret.source}) must be one of the "
                    "engine's keys")
            raise protocol.ProtocolError(
                "the reply is not signed with the gateway's label secret "
                f"({self.secret.source}): the engine runs without a secret or with "
                "another one; give it the same secret file")
        answer = protocol.decode_reply(parts[0])
        if answer.get("op") == protocol.REFUSED:
            raise protocol.ProtocolError(
                f"the engine takes only signed messages ({answer.get('error')}): give the "
                "gateway the engine's label secret (labels=...,label_secret_file=FILE, "
                "or mori serve --label-secret-file FILE)")
        return answer

    # -- the socket -------------------------------------------------------------------------
    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as e:
                sock.close(0)
                raise ValueError(f"bad label endpoint {self.endpoint!r}: {e}") from e
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
            self.resets += 1

    async def close(self) -> None:
        """Close the socket (a request in flight fails with ``LabelChannelDown``)."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
