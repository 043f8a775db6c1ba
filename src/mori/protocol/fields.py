"""The OpenAI request paths, and MORI's own request fields.

A client may put two fields of MORI's own in a request body (the gateway reads them and
removes them before the body goes to an engine; the simulated engine reads them itself):

- ``program_id`` (a string): the agent program the request belongs to (the ``openai``
  client's ``extra_body={"program_id": ...}`` puts it at the top level). The header
  ``X-Program-Id`` is an alternative (its bytes are read as UTF-8). Either way a program
  id is 1 to ``max_bytes`` bytes of UTF-8 (default ``DEFAULT_MAX_PROGRAM_ID_BYTES``, the
  gateway's ``max_program_id_bytes``), holds no control character (Unicode category Cc,
  nor U+2028 / U+2029) and does not start with ``ANONYMOUS_PREFIX`` (``anon-``: the
  gateway names anonymous requests so, ``anonymous_program_id``); anything else is a 400
  naming the rule (``check_program_id``).
- ``mori`` (an object, optional): ``{"prompt_tokens": int, "reuse_tokens": int}``, a
  synthetic prompt size used by trace replay against *simulated* engines, so that a
  100k-token prompt need not be sent as text. Either key may be left out; each is a
  non-negative integer. Only the simulated engine honours it (the gateway passes it on
  to adapters that declare ``Capability.SYNTHETIC_PROMPTS``); the gateway's own
  accounting uses it when present.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote

from mori.protocol.errors import RequestError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
"""Anthropic's Messages API (Claude Code's path; it adds the query ``?beta=true``)."""
COUNT_TOKENS = "/v1/messages/count_tokens"
"""Anthropic's token counting: ``{"input_tokens": n}`` for a Messages body."""
RESPONSES = "/v1/responses"
"""OpenAI's Responses API (Codex's path)."""
PROGRAM_ID_HEADER = "X-Program-Id"
ANONYMOUS_PREFIX = "anon-"
"""The prefix of the ids the gateway makes up for anonymous requests; reserved: a client's
program id may not start with it."""
DEFAULT_MAX_PROGRAM_ID_BYTES = 256
"""The longest program id (UTF-8 bytes) unless configured otherwise."""
MAX_PROGRAM_ID_BYTES_LIMIT = 1024
"""The most ``max_program_id_bytes`` may be: every engine's channel takes ids this long
(the vLLM plug-in's label channel takes 1024 characters)."""
SYNTHETIC_KEYS = ("prompt_tokens", "reuse_tokens")
KV_READY_LINE = b": kv-ready"
"""An SSE comment line the simulated engine sends in a stream when the request's KV is in
place (its reload or recompute can start): the end of the wait that is held time.
Clients ignore comment lines (the SSE standard); the gateway reads it to report
``KVReady`` to the policy, as the simulator does."""


def is_chat(path: str) -> bool:
    """Whether ``path`` is a chat completion (``messages``), not a completion (``prompt``)."""
    return path.endswith("/chat/completions")


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""Unicode category Cc (U+0000-001F, U+007F-009F) and the line / paragraph separators."""


def _bad_id(rule: str) -> RequestError:
    return RequestError(400, f"invalid 'program_id': {rule}", "program_id")


def check_program_id(value: object, max_bytes: int = DEFAULT_MAX_PROGRAM_ID_BYTES, *,
                     reserved_ok: bool = False) -> str:
    """``value`` if it is a valid program id (see the module doc), else ``RequestError``
    (400, ``param`` ``program_id``) naming the rule it breaks. ``reserved_ok``: an id
    starting with ``ANONYMOUS_PREFIX`` is accepted (an engine taking the gateway's ids)."""
    if not isinstance(value, str):
        raise _bad_id("it must be a string")
    if not value:
        raise _bad_id("it must not be empty")
    if len(value) > max_bytes:  # each character is at least one byte: no need to encode
        raise _bad_id(f"it must be at most {max_bytes} bytes of UTF-8")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise _bad_id("it must be valid Unicode (a lone UTF-16 surrogate such as "
                      "\\ud800 is not)") from None
    if size > max_bytes:
        raise _bad_id(f"it must be at most {max_bytes} bytes of UTF-8 (it has {size})")
    bad = _CONTROL.search(value)
    if bad is not None:
        raise _bad_id("it must not contain control characters (it has "
                      f"U+{ord(bad.group()):04X})")
    if not reserved_ok and value.startswith(ANONYMOUS_PREFIX):
        raise _bad_id(f"the prefix {ANONYMOUS_PREFIX!r} is reserved for anonymous requests")
    return value


def program_id_field(value: object, max_bytes: int = DEFAULT_MAX_PROGRAM_ID_BYTES, *,
                     reserved_ok: bool = False) -> str | None:
    """The body's ``program_id`` (None: absent), validated (``check_program_id``)."""
    if value is None:
        return None
    return check_program_id(value, max_bytes, reserved_ok=reserved_ok)


def program_id_header(value: str | bytes | None,
                      max_bytes: int = DEFAULT_MAX_PROGRAM_ID_BYTES) -> str | None:
    """A client's ``X-Program-Id`` header (None: absent), validated: the header's bytes
    (as ASGI gives them, or as Starlette hands them over, decoded as latin-1) are read as
    UTF-8, then ``check_program_id``. ``RequestError`` (400) for anything else."""
    if value is None:
        return None
    try:
        raw = value if isinstance(value, bytes) else value.encode("latin-1")
        text = raw.decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise RequestError(400, f"invalid 'program_id': the {PROGRAM_ID_HEADER} header must "
                           "be UTF-8", "program_id") from None
    return check_program_id(text, max_bytes)


def anonymous_program_id() -> str:
    """A new id for an anonymous request: ``ANONYMOUS_PREFIX`` and 128 random bits (no
    client can name it, or guess the next one)."""
    return ANONYMOUS_PREFIX + secrets.token_hex(16)


def encode_program_id(pid: str) -> str:
    """A program id as an engine's HTTP header value: its UTF-8, percent-encoded (plain
    ASCII, no separator or control character); ``decode_program_id`` reverses it."""
    return quote(pid, safe="")


def decode_program_id(value: str) -> str:
    """The program id of an ``encode_program_id`` header value; ``RequestError`` (400)
    when its percent-escapes are not UTF-8."""
    try:
        return unquote(value, errors="strict")
    except UnicodeDecodeError:
        raise RequestError(400, f"invalid 'program_id': the {PROGRAM_ID_HEADER} header must "
                           "be percent-encoded UTF-8", "program_id") from None


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
