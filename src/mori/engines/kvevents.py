"""KV-cache events from vLLM and SGLang (ZMQ + msgpack): the wire format and the subscriber.

Both engines publish, with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:PORT", "topic": "kv-events"}'``, one ZMQ
multipart message per batch: ``[topic, seq (8 bytes, big-endian), payload]``. The payload
is a msgpack ``EventBatch``, an array ``[ts, events, data_parallel_rank?]``. Each event is a
tagged msgspec struct: vLLM 0.32 encodes events as maps with a ``"type"`` key
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); SGLang and older vLLM encode them
as arrays whose first element is the tag and the rest the fields in declaration order. Both
forms are decoded here without the engines' classes, and an unknown event kind or an extra
field is skipped, not an error.

Fields used (vLLM 0.32 ``vllm/distributed/kv_events.py``; SGLang the same first six):

- ``BlockStored``: ``block_hashes`` (int or bytes; the first block's parent is
  ``parent_block_hash``, each next block's parent the one before it), ``token_ids`` (all
  blocks' tokens, concatenated), ``block_size``, ``medium`` (``"GPU"``, ``"CPU"``;
  SGLang: ``"GPU"``, ``"CPU_PINNED"``, ``"DISK"``), ``extra_keys`` (one entry per block;
  the first block of a request that carries a ``cache_salt`` has the salt there), and
  ``session_id`` (the request's ``session_id``, vLLM 0.32).
- ``BlockRemoved``: ``block_hashes``, ``medium``.
- ``AllBlocksCleared``: every block of every tier is gone (vLLM: ``/reset_prefix_cache``;
  the event goes out with the engine's next step).

``KVEventSubscriber`` reads the messages off a ZMQ SUB socket and feeds them to a
``KVBlockIndex`` (``mori.engines.kvindex``), which turns them into per-program residency.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

if TYPE_CHECKING:
    from mori.engines.kvindex import KVBlockIndex

log = logging.getLogger(__name__)

GPU_MEDIA = frozenset({"GPU", "gpu", "cuda"})
CPU_MEDIA = frozenset({"CPU", "CPU_PINNED", "cpu", "cpu_pinned"})

# Field order of the array (array_like) form of each event, after the tag.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window", "locality", "ownership", "session_id")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_FIELDS = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS,
           "AllBlocksCleared": ()}


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One decoded event: ``kind`` is the engine's tag, ``fields`` its named fields."""

    kind: str
    fields: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int | None
    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None = None


class KVEventDecodeError(ValueError):
    """A message that is not a KV-event batch."""


_decoder = msgspec.msgpack.Decoder()


def _event(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            return None
        return KVEvent(kind, {k: v for k, v in raw.items() if k != "type"})
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _FIELDS.get(kind)
        if names is None:
            return KVEvent(kind, {})
        return KVEvent(kind, dict(zip(names, raw[1:], strict=False)))
    return None


def decode_batch(payload: bytes, seq: int | None = None) -> KVEventBatch:
    """Decode one msgpack ``EventBatch`` (array or map form); unknown events are kept
    with their tag and skipped by the index."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise KVEventDecodeError(f"not msgpack: {e}") from e
    if isinstance(raw, dict):
        ts, events, dp = raw.get("ts", 0.0), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        dp = raw[2] if len(raw) > 2 else None
    else:
        raise KVEventDecodeError("not an EventBatch (expected [ts, events, ...])")
    if not isinstance(events, list):
        raise KVEventDecodeError("EventBatch.events is not a list")
    decoded = tuple(e for e in (_event(r) for r in events) if e is not None)
    return KVEventBatch(seq, float(ts) if isinstance(ts, int | float) else 0.0, decoded,
                        dp if isinstance(dp, int) else None)


def decode_message(frames: Sequence[bytes]) -> KVEventBatch:
    """A ZMQ multipart message ``[topic, seq, payload]`` (or ``[topic, payload]``)."""
    if len(frames) >= 3:
        seq = int.from_bytes(frames[-2], "big", signed=True) if len(frames[-2]) == 8 else None
        return decode_batch(frames[-1], seq)
    if len(frames) == 2:
        return decode_batch(frames[1])
    if len(frames) == 1:
        return decode_batch(frames[0])
    raise KVEventDecodeError("empty message")


def tier_of(medium: Any) -> str | None:
    """``"gpu"``, ``"cpu"``, or None for a tier MORI does not track (disk, remote)."""
    if medium is None or medium in GPU_MEDIA:
        return "gpu"
    if medium in CPU_MEDIA:
        return "cpu"
    return None


class KVEventSubscriber:
    """An asyncio task that reads a ZMQ SUB socket and feeds a ``KVBlockIndex``.

    ``endpoint`` is where the engine publishes (``tcp://127.0.0.1:5557``; the engine binds
    ``tcp://*:5557``). A message that does not decode is counted and skipped.
    """

    def __init__(self, endpoint: str, index: KVBlockIndex, topic: str = "kv-events") -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.index = index
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    async def start(self) -> None:
        if self._task is not None:
            return
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            sock.close(0)
            self._ctx.term()
            self._ctx = None
            raise ValueError(f"bad KV-events endpoint {self.endpoint!r}: {e}") from e
        self._sock = sock
        self._task = asyncio.create_task(self._run(), name=f"kv-events {self.endpoint}")
        self.connected.set()

    async def _run(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                log.warning("KV events from %s: %s", self.endpoint, e)
                await asyncio.sleep(0.5)
                continue
            try:
                batch = decode_message(frames)
            except KVEventDecodeError as e:
                self.index.stats.decode_errors += 1
                log.debug("undecodable KV-event message from %s: %s", self.endpoint, e)
                continue
            self.index.apply(batch)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
