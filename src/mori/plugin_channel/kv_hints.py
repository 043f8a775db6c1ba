"""A request's program and label as vLLM's ``kv_hints`` (no vLLM import).

vLLM (0.32 to 0.34) carries an optional ``KvHintsEnvelope`` on each request
(``vllm/v1/kv_hints/protocol.py``: ``protocol_version``, ``message_id`` and a list of
``KvHintAction`` with ``action_id``, ``action_type``, ``action_version`` and a JSON
``payload``) and hands it to the host tier's cache policy as ``ReqContext.kv_hints``. MORI's
action is :data:`ACTION_TYPE`, whose payload names the request's program and the label it
had when the gateway forwarded it::

    {"protocol_version": "1", "message_id": "...", "actions": [
        {"action_id": "mori-program", "action_type": "mori.program",
         "action_version": "1", "payload": {"program": "agent-7", "label": "busy"}}]}

The gateway builds it (:func:`envelope`, ``mori.engines.vllm``) for an engine that takes
``kv_hints`` in a request's body; the plug-in's cache policy reads the program back
(:func:`program_of`) from whatever form vLLM hands in (its msgspec structs, or plain
dicts). A request's label is the one it had while it ran (``busy``, as a rule): a label
that changes while a program has no request in flight (``idle``, ``inactive``, a drop)
reaches the engine only over the label channel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PROTOCOL_VERSION = "1"
ACTION_TYPE = "mori.program"
ACTION_VERSION = "1"
ACTION_ID = "mori-program"


def envelope(program: str, label: str, message_id: str) -> dict[str, Any]:
    """The ``kv_hints`` of one request of ``program``, labelled ``label``."""
    return {"protocol_version": PROTOCOL_VERSION, "message_id": message_id,
            "actions": [{"action_id": ACTION_ID, "action_type": ACTION_TYPE,
                         "action_version": ACTION_VERSION,
                         "payload": {"program": program, "label": label}}]}


def _field(obj: object, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def mori_payload(hints: object) -> Mapping[str, Any] | None:
    """The payload of the first MORI action in ``hints`` (an envelope as a struct or a
    dict), or ``None``."""
    if hints is None:
        return None
    actions = _field(hints, "actions")
    if not isinstance(actions, (list, tuple)):
        return None
    for action in actions:
        if _field(action, "action_type") != ACTION_TYPE:
            continue
        payload = _field(action, "payload")
        if isinstance(payload, Mapping):
            return payload
    return None


def program_of(hints: object) -> str | None:
    """The program a MORI action in ``hints`` names (a non-empty str), or ``None``."""
    payload = mori_payload(hints)
    value = None if payload is None else payload.get("program")
    return value if isinstance(value, str) and value else None


def label_of(hints: object) -> str | None:
    """The label a MORI action in ``hints`` gives (a non-empty str), or ``None``."""
    payload = mori_payload(hints)
    value = None if payload is None else payload.get("label")
    return value if isinstance(value, str) and value else None
