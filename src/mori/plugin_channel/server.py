"""The engine's end of the label channel (``mori.plugin_channel.protocol``).

A background thread owns a ZMQ ``ROUTER`` socket bound at the label endpoint and answers
every message at once: ``hello`` with what the engine is (``info()``), ``residency`` with
what it holds of each program (``residency()``, read from the scheduler's tables while the
scheduler runs: it must copy what it reads and tolerate a table changing under it), and the label
operations (``set``, ``replace``, ``drop``, ``clear``) with ``ok: true`` meaning *accepted*:
they are queued here and applied by the scheduler thread at its next step
(:meth:`LabelServer.drain`), because only that thread may touch vLLM's block pool. A
malformed message or an unknown op is logged and answered ``ok: false`` with the error;
nothing here ever raises into the engine.

Pending operations are coalesced while the engine does not step (an idle engine does not
call ``schedule()``): consecutive ``set`` messages merge (the later label wins), and a
``replace`` or ``clear`` supersedes the ``set``/``replace``/``clear`` before it (a ``drop``
before it stays, in order). At most ``max_pending`` operations wait; beyond that the oldest
are discarded with a warning.

The endpoint: ``mori_label_endpoint`` in vLLM's ``--additional-config`` JSON, else
``$MORI_LABEL_ENDPOINT``, else ``protocol.DEFAULT_LABEL_ENDPOINT``; each data-parallel rank
``r`` > 0 binds the TCP port plus ``r`` (one endpoint per engine).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from .protocol import (
    DEFAULT_LABEL_ENDPOINT,
    OPS,
    PLUGIN_VERSION,
    Message,
    ProtocolError,
    decode,
    reply,
)

# By default a child of this package's logger; each plug-in passes a child of its
# engine's logger, so that its lines go where the engine's go.
_default_logger = logging.getLogger("mori.plugin_channel.server")

ENDPOINT_ENV = "MORI_LABEL_ENDPOINT"
MAX_PENDING = 10_000
POLL_MS = 100


def label_endpoint(rank: int = 0, env: dict[str, str] | None = None,
                   configured: object = None) -> str:
    """The endpoint the engine of data-parallel rank ``rank`` binds: ``configured`` (vLLM's
    ``--additional-config '{"mori_label_endpoint": ...}'``, what ``mori vllm-args``
    prints), else ``$MORI_LABEL_ENDPOINT``, else the protocol's default."""
    if isinstance(configured, str) and configured:
        endpoint = configured
    else:
        endpoint = (env if env is not None else dict(os.environ)).get(ENDPOINT_ENV) \
            or DEFAULT_LABEL_ENDPOINT
    if rank <= 0:
        return endpoint
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if m is None:
        return f"{endpoint}-{rank}"  # ipc:// and inproc:// endpoints: a suffix
    return f"{m.group(1)}{int(m.group(2)) + rank}"


class LabelServer:
    """The ROUTER socket, its thread, and the operations waiting for the scheduler.

    ``info()`` gives the ``hello`` reply's fields besides ``plugin_version`` (``block_size``,
    ``gpu_blocks``, ``cpu_tier_tokens``, ``programs``); it runs on the server's thread, so
    it must only read plain values.
    """

    def __init__(self, endpoint: str, info: Callable[[], dict[str, Any]], *,
                 residency: Callable[[], dict[str, Any]] | None = None,
                 max_pending: int = MAX_PENDING, poll_ms: int = POLL_MS,
                 logger: logging.Logger | None = None) -> None:
        self.endpoint = endpoint
        self.log = logger or _default_logger
        self._info = info
        self._residency = residency
        self._max_pending = max_pending
        self._poll_ms = poll_ms
        self._lock = threading.Lock()
        self._pending: list[Message] = []
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.instance = uuid.uuid4().hex  # new at every engine start: restarts are seen
        self.received = 0  # messages answered (hello and bad ones included)
        self.rejected = 0  # answered ok: false

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> bool:
        """Bind and start the thread; False (logged) when the endpoint cannot be bound:
        the engine then runs with the default labels."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as e:
            self.log.error("MORI label channel: cannot bind %s (%s); running without labels",
                         self.endpoint, e)
            sock.close(0)
            ctx.term()
            return False
        self._ctx, self._sock = ctx, sock
        self._thread = threading.Thread(target=self._run, name="mori-label-server",
                                        daemon=True)
        self._thread.start()
        self.log.info("MORI label channel listening on %s", self.endpoint)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close the socket (idempotent)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                self.log.warning("MORI label channel: the server thread did not stop")
                return
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the scheduler's side -----------------------------------------------------------
    def drain(self) -> list[Message]:
        """The operations accepted since the last call, in order (coalesced)."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def enqueue(self, msg: Message) -> None:
        """Queue one label operation for the scheduler (coalescing, bounded)."""
        with self._lock:
            p = self._pending
            if msg.op in ("replace", "clear"):
                p[:] = [m for m in p if m.op == "drop"]
                p.append(msg)
            elif msg.op == "set" and p and p[-1].op == "set":
                merged = dict(p[-1].labels or {})
                merged.update(msg.labels or {})
                p[-1] = Message("set", labels=merged)
            elif msg.op == "set" and p and p[-1].op == "replace":
                merged = dict(p[-1].labels or {})
                merged.update(msg.labels or {})
                p[-1] = Message("replace", labels=merged)
            else:
                p.append(msg)
            if len(p) > self._max_pending:
                n = len(p) - self._max_pending
                del p[:n]
                self.log.warning("MORI label channel: %d pending operations discarded "
                               "(the engine has not stepped)", n)

    def residency(self) -> dict[str, Any]:
        """The ``residency`` reply: the scheduler's tables as the callback reads them, with
        the operations still pending laid over (an idle engine does not step, so a release
        sent just before a gateway restart may not be applied yet): a pending ``inactive``
        label counts, a pending ``drop`` removes the program."""
        assert self._residency is not None
        res = self._residency()
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return res
        gpu, cpu = dict(res.get("gpu", {})), dict(res.get("cpu", {}))
        inactive = set(res.get("inactive", []))
        for m in pending:
            if m.op in ("replace", "clear"):
                inactive.clear()
            if m.op in ("set", "replace"):
                for pid, label in (m.labels or {}).items():
                    if label == "inactive":
                        inactive.add(pid)
                    else:
                        inactive.discard(pid)
            elif m.op == "drop" and m.program is not None:
                inactive.discard(m.program)
                gpu.pop(m.program, None)
                cpu.pop(m.program, None)
        return {**res, "gpu": gpu, "cpu": cpu, "inactive": sorted(inactive)}

    # -- the server thread --------------------------------------------------------------
    def handle(self, frame: bytes) -> bytes:
        """The reply to one message frame (queues label operations)."""
        try:
            msg = decode(frame)
        except ProtocolError as e:
            self.rejected += 1
            self.log.warning("MORI label channel: refused a message: %s", e)
            return reply(_op_of(frame), ok=False, error=str(e))
        if msg.op == "hello":
            fields = dict(self._info())
            fields.setdefault("cpu_tier_tokens", 0)
            ops = [op for op in OPS if op != "residency" or self._residency is not None]
            return reply("hello", ok=True, plugin_version=PLUGIN_VERSION,
                         instance=self.instance, ops=ops, **fields)
        if msg.op == "residency":
            if self._residency is None:
                self.rejected += 1
                return reply("residency", ok=False,
                             error="this engine does not report residency")
            return reply("residency", ok=True, **self.residency())
        self.enqueue(msg)
        return reply(msg.op, ok=True)

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            while not self._stop.is_set():
                try:
                    if not sock.poll(self._poll_ms, zmq.POLLIN):
                        continue
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                except zmq.ZMQError as e:
                    if e.errno == zmq.ETERM:
                        break
                    self.log.warning("MORI label channel: receive failed: %s", e)
                    continue
                if len(frames) < 2:
                    continue  # a ROUTER always sees [identity, ..., payload]
                try:
                    self.received += 1
                    out = self.handle(frames[-1])
                except Exception as e:  # never let the thread die on one message
                    self.rejected += 1
                    self.log.exception("MORI label channel: error handling a message")
                    out = reply("error", ok=False, error=f"internal error: {e}")
                try:
                    sock.send_multipart([*frames[:-1], out], zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    self.log.warning("MORI label channel: reply not sent: %s", e)
        finally:
            sock.close(0)


def _op_of(frame: bytes) -> str:
    """The ``op`` of a refused message, for its reply (``error`` when there is none)."""
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError):
        return "error"
    op = obj.get("op") if isinstance(obj, dict) else None
    return op if isinstance(op, str) and len(op) <= 64 else "error"
