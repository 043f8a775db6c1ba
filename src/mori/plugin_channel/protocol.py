"""The label channel between the gateway and the MORI plug-in in each engine (vLLM's
scheduler, ``mori.vllm_plugin``, or SGLang's radix cache, ``mori.sglang_plugin``).

Transport: ZMQ. The plug-in binds a ``ROUTER`` socket at the label endpoint (default
``tcp://127.0.0.1:5558``; one endpoint per engine, i.e. per data-parallel rank); the
gateway connects a ``DEALER``. Every message is one frame holding a JSON object with the
protocol version ``v`` and an ``op``; the plug-in answers every message with one frame, a
JSON object with ``v``, ``op`` and ``ok`` (and ``error`` when not ok).

Messages (gateway -> plug-in):

- ``{"v": 1, "op": "hello"}`` -> ``{"v": 1, "op": "hello", "ok": true, "plugin_version":
  str, "instance": str, "block_size": int, "gpu_blocks": int, "cpu_tier_tokens": int,
  "programs": int, "ops": [str]}``: the handshake; ``cpu_tier_tokens`` is 0 without a CPU
  tier; ``ops`` lists the operations this plug-in answers (a gateway asks ``residency``
  only of a plug-in that lists it);
  ``instance`` is new at every engine start, so a gateway sees a restart (and re-sends its
  table) even when it missed the moment the engine was down.
- ``{"v": 1, "op": "set", "labels": {program_id: label}}``: set labels (``busy``,
  ``idle``, ``inactive``). A label for a program the engine has not seen yet is kept
  for when it comes; it changes nothing now.
- ``{"v": 1, "op": "replace", "labels": {...}}``: the full table (the gateway sends it
  after each handshake): clear, then set.
- ``{"v": 1, "op": "drop", "program": program_id}``: the program's KV is not wanted:
  its cached blocks that no running request holds are evicted now, and its label is
  forgotten.
- ``{"v": 1, "op": "clear"}``: forget every label (blocks fall back to the default).
- ``{"v": 1, "op": "residency"}`` -> ``{"v": 1, "op": "residency", "ok": true, "gpu":
  {program_id: tokens}, "cpu": {program_id: tokens}, "inactive": [program_id]}``: what
  the engine holds of each program it knows (answered at once, from the plug-in's tables):
  on the GPU, its blocks that still hold cached content, times the block size; on the CPU
  tier, its chunks there, times the chunk's tokens; ``inactive``, the programs labelled
  ``inactive`` (released), whose KV is not wanted. A restarted gateway reads it to put
  programs back where their KV is.

A malformed message or an unknown op is answered ``ok: false`` with an ``error`` and
otherwise ignored: it never stops the engine.

With a secret (``mori.plugin_channel.auth``), each message is two frames, ``[payload,
tag]``: the payload carries ``ts`` and ``nonce`` besides the fields above, and each reply
is signed too. A message that is unsigned, badly signed, replayed or too far off the
engine's clock is answered only ``{"v": 1, "op": "refused", "ok": false, "error":
"unauthenticated: WHY"}`` (unsigned): no data, no effect. The ``hello`` reply says
``auth`` (``hmac-sha256`` or ``none``) and ``max_frame_bytes``: the engine's socket drops
the connection of a peer that sends a larger frame (ZMQ's ``MAXMSGSIZE``), so a sender
splits a long ``replace`` into a ``replace`` and ``set`` messages below it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PROTOCOL_VERSION = 1
PLUGIN_VERSION = "0.1.0"
DEFAULT_LABEL_ENDPOINT = "tcp://127.0.0.1:5558"
LABELS = ("busy", "idle", "cold", "inactive")
OPS = ("hello", "set", "replace", "drop", "clear", "residency")
MAX_PROGRAM_ID = 1024  # characters; longer ids are refused
MAX_FRAME_BYTES = 1 << 20  # the engine's ZMQ MAXMSGSIZE: a larger frame drops the peer
REFUSED = "refused"  # the op of the answer to an unauthenticated message


class ProtocolError(ValueError):
    """A message that does not follow the protocol (the text says what is wrong)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One validated gateway -> plug-in message."""

    op: str
    labels: dict[str, str] | None = None  # set, replace
    program: str | None = None  # drop


def _program_id(v: object, where: str) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_PROGRAM_ID:
        raise ProtocolError(f"{where} must be a non-empty string of at most "
                            f"{MAX_PROGRAM_ID} characters")
    return v


def parse(frame: bytes) -> dict[str, Any]:
    """A message frame's JSON object; raises ``ProtocolError``."""
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a message is a JSON object")
    return obj


def decode(frame: bytes) -> Message:
    """Parse and validate one message; raises ``ProtocolError``."""
    return decode_obj(parse(frame))


def decode_obj(obj: dict[str, Any]) -> Message:
    """Validate one parsed message; raises ``ProtocolError``."""
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {obj.get('v')!r} is not {PROTOCOL_VERSION}")
    op = obj.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    if op in ("set", "replace"):
        labels = obj.get("labels")
        if not isinstance(labels, dict):
            raise ProtocolError(f"{op}: 'labels' must be an object {{program_id: label}}")
        out: dict[str, str] = {}
        for pid, label in labels.items():
            _program_id(pid, "a program id")
            if label not in LABELS:
                raise ProtocolError(f"label {label!r} of {pid!r} is not one of "
                                    f"{', '.join(LABELS)}")
            out[pid] = label
        return Message(op, labels=out)
    if op == "drop":
        return Message(op, program=_program_id(obj.get("program"), "drop: 'program'"))
    return Message(op)


def encode(op: str, **fields: Any) -> bytes:
    """One message (or reply) frame."""
    return json.dumps({"v": PROTOCOL_VERSION, "op": op, **fields},
                      separators=(",", ":")).encode()


def reply(op: str, ok: bool = True, **fields: Any) -> bytes:
    return encode(op, ok=ok, **fields)


def decode_reply(frame: bytes) -> dict[str, Any]:
    """A plug-in's reply as a dict; raises ``ProtocolError`` if it is not one."""
    try:
        obj = json.loads(frame)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ProtocolError(f"reply is not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("v") != PROTOCOL_VERSION or "ok" not in obj:
        raise ProtocolError(f"not a version-{PROTOCOL_VERSION} reply: {str(obj)[:200]}")
    return obj
