"""A trivial OpenAI-compatible upstream for gateway overhead benchmarks.

A bare asyncio HTTP/1.1 server (uvloop when installed) that answers every completion
at once with the same small JSON body, and the few GET endpoints routers probe
(``/health``, ``/v1/models``, SGLang's ``/get_model_info`` and ``/get_server_info``).
It does no model work, so what a benchmark measures through a gateway is the gateway.

    python bench/trivial_upstream.py --port 9000
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from typing import Any

MODEL = "trivial"

_COMPLETION = json.dumps({
    "id": "cmpl-trivial", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "length",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}).encode()
_GETS = {
    b"/health": b"{}",
    b"/v1/models": json.dumps({"object": "list", "data": [
        {"id": MODEL, "object": "model", "owned_by": "bench"}]}).encode(),
    b"/get_model_info": json.dumps({"model_path": MODEL, "is_generation": True}).encode(),
    b"/get_server_info": json.dumps({"model_path": MODEL}).encode(),
}


def _response(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def default_route(method: bytes, path: bytes) -> bytes:
    """The answer to a request: every POST is a completion, the GETs ``_GETS``."""
    if method == b"POST":
        return _response(b"200 OK", _COMPLETION)
    if path in _GETS:
        return _response(b"200 OK", _GETS[path])
    return _response(b"404 Not Found", b'{"error":"not found"}')


class Conn(asyncio.Protocol):
    """One connection: each whole request is answered by ``route(method, path)`` (the
    query string left out)."""

    def __init__(self, route: Callable[[bytes, bytes], bytes] = default_route) -> None:
        self.buf = b""
        self.transport: Any = None
        self.route = route

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length:]
            method, path = head.split(b" ", 2)[:2]
            self.transport.write(self.route(method, path.split(b"?", 1)[0]))


async def serve(host: str, port: int,
                route: Callable[[bytes, bytes], bytes] = default_route) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Conn(route), host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    args = ap.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.host, args.port))
    else:
        uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
