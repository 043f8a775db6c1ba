"""The gateway's end of the label channel to the MORI plug-in in one vLLM engine.

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
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.asyncio

from mori.plugin_channel import protocol


class LabelChannelError(Exception):
    """A label-channel request that did not succeed."""


class LabelChannelDown(LabelChannelError):
    """The plug-in did not answer in time, or answered something that is not a reply."""


class LabelRefused(LabelChannelError):
    """The plug-in answered ``ok: false`` (its ``error`` is the message)."""


class LabelChannel:
    """An asyncio DEALER client for one engine's label endpoint."""

    def __init__(self, endpoint: str, timeout_s: float = 2.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"a label-channel timeout is > 0 s, got {timeout_s}")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
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
        return await self._request("hello")

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
        """Set several labels in one message (the engine keeps its others)."""
        for pid, label in labels.items():
            self.record(pid, label)
        await self._request("set", labels=dict(labels))

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
        await self._request("replace", whole_table=True)

    async def _request(self, op: str, whole_table: bool = False, **fields: Any
                       ) -> dict[str, Any]:
        async with self._lock:
            if whole_table:  # the table as it is when the message leaves
                fields["labels"] = dict(self.table)
            frame = protocol.encode(op, **fields)
            sock = self._socket()
            try:
                async with asyncio.timeout(self.timeout_s):
                    await sock.send(frame)
                    parts = await sock.recv_multipart()
                answer = protocol.decode_reply(parts[-1])
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

    # -- the socket -------------------------------------------------------------------------
    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a connected peer
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
