"""The Gemini API's errors: ``{"error": {"code": 400, "message": ..., "status":
"INVALID_ARGUMENT"}}``, the ``status`` being Google's canonical code for the HTTP status
(``STATUS_NAMES``). A refusal that says when to come back (the gateway's 429 and 503)
carries it as a ``google.rpc.RetryInfo`` detail, which Gemini CLI waits for before it
retries. An error after a stream began is sent as the Gemini API sends it: the same
object as raw JSON on a line of its own (not a ``data:`` event), which both SDKs raise
as an error of its ``code`` (the JavaScript one, Gemini CLI's, where it arrives in a read
of its own); the stream ends there."""

from __future__ import annotations

import json
from typing import Any

STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 405: "UNIMPLEMENTED", 409: "ABORTED",
                413: "INVALID_ARGUMENT", 422: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
                499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED", 502: "UNAVAILABLE",
                503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
"""Google's canonical status for an HTTP status (others: ``UNKNOWN``)."""
RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


def gemini_error_body(status: int, message: str, retry_after_s: float | None = None
                      ) -> dict[str, Any]:
    """An error in the Gemini API's shape; ``retry_after_s`` adds a ``RetryInfo``
    detail (whole seconds, at least 1)."""
    err: dict[str, Any] = {"code": status, "message": message,
                           "status": STATUS_NAMES.get(status, "UNKNOWN")}
    if retry_after_s is not None:
        err["details"] = [{"@type": RETRY_INFO,
                           "retryDelay": f"{max(1, round(retry_after_s))}s"}]
    return {"error": err}


def gemini_error_event(status: int, message: str) -> bytes:
    """An error inside a Gemini SSE stream, as the API sends it (the module doc)."""
    return json.dumps(gemini_error_body(status, message)).encode() + b"\n\n"


_OPENAI_TYPES = {"invalid_request_error": 400, "authentication_error": 401,
                 "permission_error": 403, "not_found_error": 404, "rate_limit_error": 429,
                 "upstream_error": 502, "service_unavailable": 503, "overloaded_error": 503,
                 "timeout_error": 504}


def engine_error(status: int, raw: bytes | Any) -> tuple[int, str]:
    """The status and message of an engine's error (an OpenAI-style ``{"error": {...}}``
    body or event, ``{"detail": ...}``, or any text), for the Gemini API's shape. A
    stream's error event has no HTTP status: ``status`` 0 takes it from the error's
    ``code`` (a number) or ``type``."""
    data = raw
    if isinstance(raw, (bytes, bytearray)):
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            text = bytes(raw).decode("utf-8", "replace").strip()
            return status or 500, text[:1000] or f"the engine answered {status}"
    err = data.get("error") if isinstance(data, dict) else None
    message: Any = None
    if isinstance(err, dict):
        message = err.get("message")
        if not status:
            code, kind = err.get("code"), err.get("type")
            status = code if isinstance(code, int) and 400 <= code < 600 else \
                _OPENAI_TYPES.get(kind, 500) if isinstance(kind, str) else 500
    elif isinstance(err, str):
        message = err
    elif isinstance(data, dict):
        message = data.get("detail", data.get("message"))
    if not isinstance(message, str):
        message = json.dumps(message if message is not None else data)[:1000]
    return status or 500, message
