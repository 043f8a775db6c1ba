"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from starlette.responses import Response

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 502: "upstream_error",
          503: "service_unavailable", 504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, retry_after_s: float | None = None) -> Response:
    headers = {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return Response(json.dumps(error_body(status, message, param, code)), status_code=status,
                    media_type="application/json", headers=headers)


def sse_error(status: int, message: str) -> bytes:
    """An error event in an SSE stream, then the stream's end."""
    return (b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"
            b"data: [DONE]\n\n")


class RequestError(Exception):
    """A client request is malformed; becomes an OpenAI-style 4xx."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> Response:
        return error_response(self.status, self.message, self.param, self.code)
