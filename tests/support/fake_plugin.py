"""A fake MORI vLLM plug-in: the label channel's engine end, for the gateway's tests.

A ZMQ ROUTER in the caller's event loop that answers every message as
``mori.plugin_channel.protocol`` says, keeps the label table it is sent, and records every
message; it can go silent, answer late, or restart as another instance. ``residency`` is
what it answers the op of that name (None: an older plug-in, which does not list the op).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from typing import Any

import zmq
import zmq.asyncio

from mori.plugin_channel import protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakePlugin:
    """The plug-in's end: binds a ROUTER at ``endpoint``, answers every message as the
    protocol says (``silent``: receives and answers nothing), keeps the label table."""

    def __init__(self, port: int | None = None, cpu_tier_tokens: int = 0,
                 residency: dict[str, Any] | None = None, disk_tier_tokens: int = 0) -> None:
        self.instance = uuid.uuid4().hex
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.cpu_tier_tokens = cpu_tier_tokens
        self.disk_tier_tokens = disk_tier_tokens
        self.residency = residency
        self.received: list[dict[str, Any]] = []
        self.labels: dict[str, str] = {}
        self.silent = False
        self.delay_s = 0.0
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def ops(self) -> list[str]:
        return [m.get("op", "?") for m in self.received]

    async def start(self) -> FakePlugin:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        for _ in range(50):  # the port of a plug-in just stopped may take a moment
            try:
                sock.bind(self.endpoint)
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"cannot bind {self.endpoint}")
        self._sock = sock
        self._task = asyncio.create_task(self._serve())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def restart(self) -> None:
        """The engine restarted: a new socket on the same endpoint, no labels."""
        await self.stop()
        self.labels = {}
        self.instance = uuid.uuid4().hex
        await self.start()

    def close(self) -> None:
        self._ctx.term()

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            ident, *frames = await self._sock.recv_multipart()
            self.received.append(json.loads(frames[-1]))
            if self.silent:
                continue
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            await self._sock.send_multipart([ident, self.answer(frames[-1])])

    def answer(self, frame: bytes) -> bytes:
        try:
            m = protocol.decode(frame)
        except protocol.ProtocolError as e:
            return protocol.reply("error", ok=False, error=str(e))
        if m.op == "hello":
            ops = [op for op in protocol.OPS if op != "residency" or self.residency is not None]
            return protocol.reply("hello", plugin_version=protocol.PLUGIN_VERSION,
                                  instance=self.instance, block_size=32, gpu_blocks=64,
                                  cpu_tier_tokens=self.cpu_tier_tokens,
                                  disk_tier_tokens=self.disk_tier_tokens,
                                  programs=len(self.labels), ops=ops)
        if m.op == "residency":
            if self.residency is None:
                return protocol.reply("residency", ok=False, error="unknown op")
            return protocol.reply("residency", **self.residency)
        if m.op == "set":
            self.labels.update(m.labels or {})
        elif m.op == "replace":
            self.labels = dict(m.labels or {})
        elif m.op == "drop":
            self.labels.pop(m.program or "", None)
        elif m.op == "clear":
            self.labels.clear()
        return protocol.reply(m.op)
