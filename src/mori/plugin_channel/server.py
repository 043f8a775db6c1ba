"""The engine's end of the label channel (``mori.plugin_channel.protocol``).

A background thread owns a ZMQ ``ROUTER`` socket bound at the label endpoint and answers
every message at once: ``hello`` with what the engine is (``info()``), ``residency`` with
what it holds of each program (``residency()``, read from the scheduler's tables while the
scheduler runs: it must copy what it reads and tolerate a table changing under it), and
the label operations (``set``, ``replace``, ``drop``, ``clear``) with ``ok: true`` meaning
*accepted*: they are queued here and applied by the scheduler thread at its next step
(:meth:`LabelServer.drain`), because only that thread may touch the engine's KV cache
(vLLM's block pool, SGLang's radix tree). A
malformed message or an unknown op is logged and answered ``ok: false`` with the error;
nothing here ever raises into the engine.

Pending operations are kept bounded in labels, not in messages
(:class:`~mori.plugin_channel.pending.PendingLabels`): per program a drop and a label at
most, a ``replace`` or ``clear`` superseding the labels before it, at most
``max_pending_labels`` labels and as many drops (beyond, the least recently set label is
forgotten, as the engine's label table would forget it).

Who may talk to it (``mori.plugin_channel.auth``): with a secret, only a peer that signs
every message with it; anything else (unsigned, badly signed, replayed, or off the
engine's clock) is answered with a bare refusal, changes nothing, and is logged (at most a
line per reason every 10 s). Without a secret, only a loopback or ``ipc://`` endpoint is
bound: any other is refused at start-up (:class:`~mori.plugin_channel.auth.ExposureError`).
The socket drops the connection of a peer that sends a frame over ``max_frame_bytes``
before reading it (ZMQ's ``MAXMSGSIZE``) and queues at most ``RCVHWM`` messages per peer.

The endpoint: ``mori_label_endpoint`` in the plug-in's ``config`` (vLLM's
``--additional-config`` JSON; the SGLang plug-in passes only an endpoint it was given),
else ``$MORI_LABEL_ENDPOINT``, else ``protocol.DEFAULT_LABEL_ENDPOINT``; each data-parallel rank
``r`` > 0 binds the TCP port plus ``r`` (one endpoint per engine). The secret:
``mori_label_secret_file`` there, else ``$MORI_LABEL_SECRET_FILE``, else
``$MORI_LABEL_SECRET`` (:func:`configured_server` reads them all).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from .auth import (
    LabelSecret,
    RateLimitedLog,
    ReplayGuard,
    check_exposure,
    secret_from,
)
from .labels import MAX_PROGRAMS
from .pending import PendingLabels
from .protocol import (
    DEFAULT_LABEL_ENDPOINT,
    MAX_FRAME_BYTES,
    OPS,
    PLUGIN_VERSION,
    REFUSED,
    Message,
    ProtocolError,
    decode,
    decode_obj,
    parse,
    reply,
)

# By default a child of this package's logger; each plug-in passes a child of its
# engine's logger, so that its lines go where the engine's go.
_default_logger = logging.getLogger("mori.plugin_channel.server")

ENDPOINT_ENV = "MORI_LABEL_ENDPOINT"
ENDPOINT_KEY = "mori_label_endpoint"  # in a plug-in's config (vLLM's --additional-config)
SECRET_FILE_KEY = "mori_label_secret_file"  # the same (vLLM's --additional-config)
MAX_PENDING_LABELS = MAX_PROGRAMS
RCVHWM = 64  # messages queued per peer before ZMQ stops reading from it
POLL_MS = 100


def label_endpoint(rank: int = 0, env: Mapping[str, str] | None = None,
                   configured: object = None) -> str:
    """The endpoint the engine of data-parallel rank ``rank`` binds: ``configured`` (vLLM's
    ``--additional-config '{"mori_label_endpoint": ...}'``, what ``mori vllm-args``
    prints), else ``$MORI_LABEL_ENDPOINT``, else the protocol's default."""
    if isinstance(configured, str) and configured:
        endpoint = configured
    else:
        endpoint = (env if env is not None else os.environ).get(ENDPOINT_ENV) \
            or DEFAULT_LABEL_ENDPOINT
    if rank <= 0:
        return endpoint
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if m is None:
        return f"{endpoint}-{rank}"  # ipc:// and inproc:// endpoints: a suffix
    return f"{m.group(1)}{int(m.group(2)) + rank}"


def configured_server(info: Callable[[], dict[str, Any]], *, rank: int = 0,
                      config: Mapping[str, Any] | None = None,
                      env: Mapping[str, str] | None = None,
                      residency: Callable[[], dict[str, Any]] | None = None,
                      logger: logging.Logger | None = None) -> LabelServer:
    """The label server a plug-in starts: its endpoint and secret from ``config`` (vLLM's
    ``--additional-config``, or what the SGLang plug-in passes: ``mori_label_endpoint``,
    ``mori_label_secret_file``) or the environment. Raises ``ValueError`` (``auth.SecretError``, ``auth.ExposureError``,
    saying how to fix it) for a secret that cannot be read and for an endpoint others can
    reach without a secret: the engine must not start so."""
    config = config or {}
    env = os.environ if env is None else env
    endpoint = label_endpoint(rank, env, configured=config.get(ENDPOINT_KEY))
    secret_file = config.get(SECRET_FILE_KEY)
    if secret_file is not None and not (isinstance(secret_file, str) and secret_file):
        raise ValueError(f"MORI label channel: {SECRET_FILE_KEY} must be a path, got "
                         f"{secret_file!r}")
    secret = secret_from(secret_file, env, logger)
    return LabelServer(endpoint, info, residency=residency, secret=secret, logger=logger)


class LabelServer:
    """The ROUTER socket, its thread, and the operations waiting for the scheduler.

    ``info()`` gives the ``hello`` reply's fields besides ``plugin_version`` (``block_size``,
    ``gpu_blocks``, ``cpu_tier_tokens``, ``programs``); it runs on the server's thread, so
    it must only read plain values. ``secret``: the key every message must be signed with
    (None: unsigned messages, on a loopback or ``ipc://`` endpoint only; any other raises
    ``auth.ExposureError`` here).
    """

    def __init__(self, endpoint: str, info: Callable[[], dict[str, Any]], *,
                 residency: Callable[[], dict[str, Any]] | None = None,
                 secret: LabelSecret | None = None,
                 max_pending_labels: int = MAX_PENDING_LABELS,
                 max_frame_bytes: int = MAX_FRAME_BYTES, poll_ms: int = POLL_MS,
                 replay: ReplayGuard | None = None,
                 logger: logging.Logger | None = None) -> None:
        check_exposure(endpoint, secret, side="engine")
        if max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {max_frame_bytes}")
        self.endpoint = endpoint
        self.log = logger or _default_logger
        self._info = info
        self._residency = residency
        self.secret = secret
        self.max_frame_bytes = max_frame_bytes
        self._replay = replay or ReplayGuard()
        self._refusals = RateLimitedLog(self.log)
        self._poll_ms = poll_ms
        self._lock = threading.Lock()
        self._pending = PendingLabels(max_pending_labels)
        self._stop = threading.Event()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._sock: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self.instance = uuid.uuid4().hex  # new at every engine start: restarts are seen
        self.received = 0  # messages answered (hello and bad ones included)
        self.rejected = 0  # answered ok: false
        self.unauthenticated = 0  # refused for want of a good signature: no effect

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> bool:
        """Bind and start the thread; False (logged) when the endpoint cannot be bound:
        the engine then runs with the default labels."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # before any byte is kept
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.SNDHWM, RCVHWM)
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
        self.log.info("MORI label channel listening on %s (%s)", self.endpoint,
                      f"messages signed with the secret of {self.secret.source}"
                      if self.secret else "no secret: this machine only")
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
        """The operations accepted since the last call, in the order to apply them
        (drops, then a reset, then one ``set``: ``pending.PendingLabels``)."""
        with self._lock:
            return self._pending.drain()

    def pending(self) -> int:
        """Labels and drops waiting for the scheduler."""
        with self._lock:
            return len(self._pending)

    def enqueue(self, msg: Message) -> None:
        """Queue one label operation for the scheduler (merged, bounded in labels)."""
        with self._lock:
            n = self._pending.add(msg)
        if n:
            self._refusals.warning(
                "pending", "MORI label channel: over %d labels waiting for the engine's "
                "next step: the %d least recently set forgotten (the label table would "
                "forget them too)", self._pending.max_labels, n)

    def residency(self) -> dict[str, Any]:
        """The ``residency`` reply: the scheduler's tables as the callback reads them, with
        the operations still pending laid over (an idle engine does not step, so a release
        sent just before a gateway restart may not be applied yet): a pending ``inactive``
        label counts, a pending ``drop`` removes the program."""
        assert self._residency is not None
        res = self._residency()
        with self._lock:
            pending = self._pending.messages()
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
        """The reply to one unsigned message frame (queues label operations)."""
        try:
            msg = decode(frame)
        except ProtocolError as e:
            return self._refuse(_op_of(frame), e)
        return self._answer(msg)

    def handle_frames(self, body: list[bytes], peer: str = "") -> list[bytes]:
        """The reply frames to one message's frames (without the ROUTER's identity):
        ``[payload]``, or ``[payload, tag]`` when signed. With a secret, a message that is
        not rightly signed and fresh gets one unsigned refusal frame and changes nothing."""
        if self.secret is None:
            if len(body) not in (1, 2):
                return self._unauthenticated(f"{len(body)} frames (1 or 2 expected)", peer)
            return [self.handle(body[0])]
        if len(body) != 2:
            return self._unauthenticated(
                "unsigned message (this channel takes only messages signed with the "
                "shared secret)" if len(body) == 1 else f"{len(body)} frames (a message "
                "and its signature expected)", peer)
        payload, tag = body
        key = self.secret.verify_request(payload, tag)
        if key is None:
            return self._unauthenticated("bad signature (not made with this engine's "
                                         "label secret)", peer)
        try:
            obj = parse(payload)
        except ProtocolError as e:  # signed, so the gateway's own bug: say what it was
            out = self._refuse("error", e)
        else:
            why = self._replay.check(obj.get("ts"), obj.get("nonce"))
            if why is not None:
                return self._unauthenticated(why, peer)
            try:
                out = self._answer(decode_obj(obj))
            except ProtocolError as e:
                out = self._refuse(_op_of(payload), e)
        return [out, self.secret.sign_reply(key, tag, out)]

    def _answer(self, msg: Message) -> bytes:
        if msg.op == "hello":
            fields = dict(self._info())
            fields.setdefault("cpu_tier_tokens", 0)
            ops = [op for op in OPS if op != "residency" or self._residency is not None]
            return reply("hello", ok=True, plugin_version=PLUGIN_VERSION,
                         instance=self.instance, ops=ops,
                         auth="hmac-sha256" if self.secret else "none",
                         max_frame_bytes=self.max_frame_bytes, **fields)
        if msg.op == "residency":
            if self._residency is None:
                self.rejected += 1
                return reply("residency", ok=False,
                             error="this engine does not report residency")
            return reply("residency", ok=True, **self.residency())
        self.enqueue(msg)
        return reply(msg.op, ok=True)

    def _refuse(self, op: str, e: Exception) -> bytes:
        self.rejected += 1
        self._refusals.warning(f"bad:{op}", "MORI label channel: refused a message: %s", e)
        return reply(op, ok=False, error=str(e))

    def _unauthenticated(self, why: str, peer: str) -> list[bytes]:
        self.unauthenticated += 1
        self._refusals.warning(
            f"auth:{why.split(' (')[0]}", "MORI label channel: ignored a message%s: %s",
            f" from {peer}" if peer else "", why)
        return [reply(REFUSED, ok=False, error=f"unauthenticated: {why}")]

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        try:
            while not self._stop.is_set():
                try:
                    if not sock.poll(self._poll_ms, zmq.POLLIN):
                        continue
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                except zmq.ZMQError as e:
                    if e.errno == zmq.ETERM:
                        break
                    self.log.warning("MORI label channel: receive failed: %s", e)
                    continue
                if len(frames) < 2:
                    continue  # a ROUTER always sees [identity, ..., payload]
                identity = frames[0].bytes
                try:
                    self.received += 1
                    out = self.handle_frames([f.bytes for f in frames[1:]],
                                             _peer(frames[-1]))
                except Exception as e:  # never let the thread die on one message
                    self.rejected += 1
                    self.log.exception("MORI label channel: error handling a message")
                    out = [reply("error", ok=False, error=f"internal error: {e}")]
                del frames  # a refused message's memory goes now, not at the next one
                try:
                    sock.send_multipart([identity, *out], zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    self.log.warning("MORI label channel: reply not sent: %s", e)
        finally:
            sock.close(0)


def _peer(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError, KeyError):
        return ""


def _op_of(frame: bytes) -> str:
    """The ``op`` of a refused message, for its reply (``error`` when there is none)."""
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "error"
    op = obj.get("op") if isinstance(obj, dict) else None
    return op if isinstance(op, str) and len(op) <= 64 else "error"
