"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

``RequestError`` is a request refused with such a body; ``clip`` cuts a client's value
that a message quotes. This module imports no HTTP
library (the simulator raises ``RequestError`` too); the Starlette response is built in
``mori.protocol.responses``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.responses import Response

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 502: "upstream_error",
               503: "service_unavailable", 504: "timeout_error"}
"""The error ``type`` for a status, unless one is given (others: ``api_error``)."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               *, type_: str | None = None) -> dict[str, Any]:
    """The error object; ``type_`` None: the status's type (``ERROR_TYPES``)."""
    return {"error": {"message": message, "type": type_ or ERROR_TYPES.get(status, "api_error"),
                      "param": param, "code": code}}


ECHO_LIMIT = 256
"""The most characters of a client's value (a model name, an id, a header) an error
message quotes (``clip``)."""


def clip(value: str, limit: int = ECHO_LIMIT) -> str:
    """``value`` as an error message may quote it: whole up to ``limit`` characters, else
    its first ``limit`` with an ellipsis and its length (a client's 1 MB model name is not
    sent back whole)."""
    if len(value) <= limit:
        return value
    return f"{value[:limit]}… ({len(value)} characters)"


def sse_event(data: Any) -> bytes:
    """One SSE ``data:`` event carrying ``data`` as JSON."""
    return b"data: " + json.dumps(data).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(status: int, message: str) -> bytes:
    """An error event in an SSE stream, then the stream's end."""
    return sse_event(error_body(status, message)) + SSE_DONE


class RequestError(ValueError):
    """A request refused with an OpenAI-style error: ``status`` (4xx, or 503 for an engine
    that is full), ``param``, ``code`` and ``type`` as OpenAI reports them."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, *, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ERROR_TYPES.get(status, "api_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code, type_=self.type)

    def response(self) -> Response:
        # imported here so that raising a RequestError needs no HTTP library
        from mori.protocol.responses import error_response

        return error_response(self.status, self.message, self.param, self.code,
                              type_=self.type)
