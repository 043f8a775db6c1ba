"""The gateway's errors: OpenAI-style bodies and ``RequestError``, as
``mori.protocol.errors`` and ``mori.protocol.responses`` define them for every MORI
server."""

from __future__ import annotations

from mori.protocol.errors import RequestError, error_body, sse_error
from mori.protocol.responses import error_response

__all__ = ["RequestError", "error_body", "error_response", "sse_error"]
