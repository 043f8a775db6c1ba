"""The OpenAI request paths, and MORI's own request fields.

A client may put two fields of MORI's own in a request body (the gateway reads them and
removes them before the body goes to an engine; the simulated engine reads them itself):

- ``program_id`` (a non-empty string): the agent program the request belongs to (the
  ``openai`` client's ``extra_body={"program_id": ...}`` puts it at the top level). The
  header ``X-Program-Id`` is an alternative.
- ``mori`` (an object, optional): ``{"prompt_tokens": int, "reuse_tokens": int}``, a
  synthetic prompt size used by trace replay against *simulated* engines, so that a
  100k-token prompt need not be sent as text. Either key may be left out; each is a
  non-negative integer. Only the simulated engine honours it (the gateway passes it on
  to adapters that declare ``Capability.SYNTHETIC_PROMPTS``); the gateway's own
  accounting uses it when present.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mori.protocol.errors import RequestError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROGRAM_ID_HEADER = "X-Program-Id"
SYNTHETIC_KEYS = ("prompt_tokens", "reuse_tokens")
KV_READY_LINE = b": kv-ready"
"""An SSE comment line the simulated engine sends in a stream when the request's KV is in
place (its reload or recompute can start): the end of the wait that is gated time.
Clients ignore comment lines (the SSE standard); the gateway reads it to report
``KVReady`` to the policy, as the simulator does."""


def is_chat(path: str) -> bool:
    """Whether ``path`` is a chat completion (``messages``), not a completion (``prompt``)."""
    return path.endswith("/chat/completions")


def program_id_field(value: object) -> str | None:
    """The body's ``program_id`` (None: absent), or ``RequestError`` if it is not a
    non-empty string."""
    if value is not None and (not isinstance(value, str) or not value):
        raise RequestError(400, "'program_id' must be a non-empty string", "program_id")
    return value


def synthetic_field(value: object) -> dict[str, int]:
    """The ``mori`` field's sizes that are present (``SYNTHETIC_KEYS``), validated; other
    keys are left out. ``RequestError`` for anything but an object of non-negative ints."""
    if not isinstance(value, Mapping):
        raise RequestError(400, "'mori' must be an object {prompt_tokens, reuse_tokens}",
                           "mori")
    out: dict[str, int] = {}
    for key in SYNTHETIC_KEYS:
        x = value.get(key)
        if x is None:
            continue
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise RequestError(400, f"'mori.{key}' must be a non-negative integer",
                               f"mori.{key}")
        out[key] = x
    return out


def synthetic_sizes(body: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(prompt_tokens, reuse_tokens)`` from the body's ``mori`` field (None: absent)."""
    raw = body.get("mori")
    if raw is None:
        return None, None
    sizes = synthetic_field(raw)
    return sizes.get("prompt_tokens"), sizes.get("reuse_tokens")
