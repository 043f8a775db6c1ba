"""The OpenAI-compatible HTTP transport every adapter builds on.

``OpenAIHTTPAdapter`` forwards requests through a lean keep-alive HTTP/1.1 client
(``mori.engines.http1_client``: the per-request path) and makes control calls (health, metrics, KV
controls, tokenize) with aiohttp. It passes SSE streams through chunk by chunk and
turns transport failures into ``UpstreamError`` with the status the client should see:
503 when the engine refuses connections, 504 when it times out, 502 when it breaks the
protocol or dies mid-stream. An answer read whole (a forward that is not streamed, a
control-plane call) is at most ``max_response_bytes`` (``--max-response-bytes``): beyond,
the connection is dropped, so the engine aborts, and the error is ``ResponseTooLarge``
(502). Subclasses add capacity and the engine's KV controls.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from mori.engines.base import (
    EngineAdapter,
    EngineLoad,
    KVCapacity,
    RequestHints,
    ResponseTooLarge,
    UpstreamError,
    UpstreamResponse,
)
from mori.engines.http1_client import (
    AbortedError,
    BrokenError,
    H1Pool,
    ReadTimeout,
    RefusedError,
    TooLargeError,
)

_PASS_HEADERS = ("content-type", "cache-control")
_encode = msgspec.json.Encoder().encode


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus text exposition: name -> [(labels, value), ...]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        if "{" in line:
            name, rest = line.split("{", 1)
            body, _, tail = rest.rpartition("}")
            for part in _split_labels(body):
                k, _, v = part.partition("=")
                labels[k.strip()] = v.strip().strip('"')
            value_s = tail.split()[0] if tail.split() else "nan"
        else:
            fields = line.split()
            if len(fields) < 2:
                continue
            name, value_s = fields[0], fields[1]
        try:
            value = float(value_s)
        except ValueError:
            continue
        out.setdefault(name.strip(), []).append((labels, value))
    return out


def _split_labels(body: str) -> list[str]:
    parts, cur, quoted, esc = [], [], False, False
    for ch in body:
        if esc:
            cur.append(ch)
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == '"':
            quoted = not quoted
            cur.append(ch)
        elif ch == "," and not quoted:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def _decode(data: bytes, charset: str | None) -> str:
    try:
        return data.decode(charset or "utf-8", "replace")
    except LookupError:  # a charset Python does not know
        return data.decode("utf-8", "replace")


def metric_sum(samples: dict[str, list[tuple[dict[str, str], float]]], name: str,
               default: float = 0.0) -> float:
    """Sum of a metric's samples over its label sets (``default`` when absent)."""
    rows = samples.get(name)
    return sum(v for _, v in rows) if rows else default


class OpenAIHTTPAdapter(EngineAdapter):
    """Any OpenAI-compatible server; capacity is whatever the operator configures.

    ``kv_tokens``: the replica's GPU KV capacity in tokens (the generic engine cannot
    report it); ``page_tokens``: its page (block) size.
    """

    kind = "openai"

    def __init__(self, url: str, *, timeout_s: float = 600.0, kv_tokens: int = 0,
                 page_tokens: int = 16, connect_timeout_s: float = 5.0) -> None:
        super().__init__(url, timeout_s=timeout_s)
        self.kv_tokens = kv_tokens
        self.page_tokens = page_tokens
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._h1: H1Pool | None = None

    async def start(self) -> None:
        if self._session is None:
            conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=conn, auto_decompress=False,
                                                  headers=self.session_headers())

    def abort_requests(self, reason: str) -> int:
        return 0 if self._h1 is None else self._h1.abort(reason)

    async def close(self) -> None:
        if self._h1 is not None:
            await self._h1.close()
            self._h1 = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(f"adapter for {self.url} used before start()")
        return self._session

    # -- engine-specific request shaping (subclasses override) ------------------------------
    def shape_body(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        """The body as this engine wants it (hints mapped onto its request fields)."""
        return body

    def request_headers(self, hints: RequestHints) -> dict[str, str]:
        return {}

    def session_headers(self) -> dict[str, str]:
        """Headers sent on every control-plane call (credentials the engine wants);
        forwards send ``request_headers``."""
        return {}

    # -- forwarding -------------------------------------------------------------------------
    def _pool(self) -> H1Pool:
        """The lean keep-alive client the forwards go through (``mori.engines.http1_client``)."""
        if self._h1 is None:
            self._h1 = H1Pool(self.url, connect_timeout=self.connect_timeout_s,
                              read_timeout=self.timeout_s,
                              head_timeout=min(self.timeout_s, self.first_byte_timeout_s
                                               or self.timeout_s))
        return self._h1

    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        payload = _encode(self.shape_body(body, hints))
        headers = {"content-type": "application/json", **self.request_headers(hints)}
        try:
            resp = await self._pool().post(path, payload, headers)
        except RefusedError as e:
            raise UpstreamError(f"engine {self.url} refused the connection: {e}",
                                status=503) from e
        except ReadTimeout as e:
            # no answer began in time: a hung engine, or a very long one; the gateway
            # probes its health at once rather than giving up on it for one request
            raise UpstreamError(f"engine {self.url} sent no answer within "
                                f"{self._pool().head_timeout:g} s: {e}", status=504,
                                unhealthy=False) from e
        except AbortedError as e:
            raise UpstreamError(f"engine {self.url} was given up: {e}", status=503,
                                unhealthy=False) from e
        except BrokenError as e:
            raise UpstreamError(f"engine {self.url} failed: {e}", status=502) from e
        out_headers = {k: v for k, v in resp.headers.items() if k in _PASS_HEADERS}
        if not (stream and resp.status == 200 and resp.content_type == "text/event-stream"):
            try:
                data = await resp.read(self.max_response_bytes)
            except TooLargeError as e:
                raise ResponseTooLarge(f"engine {self.url} sent an answer over {e.limit} "
                                       f"bytes (--max-response-bytes; the request was "
                                       f"aborted): {e}") from e
            except AbortedError as e:
                raise UpstreamError(f"engine {self.url} was given up: {e}", status=503,
                                    unhealthy=False) from e
            except (BrokenError, ReadTimeout) as e:
                raise UpstreamError(f"engine {self.url} broke off its answer: {e}") from e
            finally:
                resp.release()
            return UpstreamResponse(resp.status, out_headers, body=data)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.chunks():
                    yield chunk
            except AbortedError as e:
                raise UpstreamError(f"engine {self.url} was given up: {e}", status=503,
                                    unhealthy=False) from e
            except (BrokenError, ReadTimeout) as e:
                raise UpstreamError(f"engine {self.url} died mid-stream: {e}") from e

        async def closer() -> None:
            if resp.at_eof:
                resp.release()
            else:
                resp.close()  # drop the connection: the engine aborts the request

        return UpstreamResponse(resp.status, out_headers, chunks=chunks(), _closer=closer)

    async def _call(self, method: str, path: str, payload: dict[str, Any] | None,
                    timeout_s: float, as_text: bool = False) -> Any:
        """One control-plane request; transport failures and error statuses become
        ``UpstreamError`` (a GET answering non-200 is unhealthy, a refused POST is not)."""
        try:
            async with self.session.request(
                    method, self.url + path, json=payload if method == "POST" else None,
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                if method == "GET" and r.status != 200:
                    raise UpstreamError(f"engine {self.url}{path} answered {r.status}")
                if r.status >= 400:  # the start of what it said is enough
                    said = _decode(await r.content.read(1024), r.charset)
                    raise UpstreamError(f"engine {self.url}{path} answered {r.status}: "
                                        f"{said[:200]}", unhealthy=False)
                text = _decode(await self._read_bounded(r, path), r.charset)
                if as_text:
                    return text
                return json.loads(text) if text.strip() else None
        except aiohttp.ClientError as e:
            raise UpstreamError(f"engine {self.url}{path}: {e}", status=503) from e
        except TimeoutError as e:
            raise UpstreamError(f"engine {self.url}{path} timed out", status=504) from e

    async def _read_bounded(self, r: aiohttp.ClientResponse, path: str) -> bytes:
        """A control-plane answer's body, at most ``max_response_bytes`` (beyond:
        ``ResponseTooLarge``, the connection dropped)."""
        limit = self.max_response_bytes
        if r.content_length is not None and r.content_length > limit:
            r.close()
            raise ResponseTooLarge(f"engine {self.url}{path} sent an answer over {limit} "
                                   f"bytes (--max-response-bytes): its Content-Length is "
                                   f"{r.content_length}")
        buf = bytearray()
        async for chunk in r.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                r.close()
                raise ResponseTooLarge(f"engine {self.url}{path} sent an answer over "
                                       f"{limit} bytes (--max-response-bytes)")
        return bytes(buf)

    async def get_json(self, path: str, timeout_s: float = 5.0) -> Any:
        return await self._call("GET", path, None, timeout_s)

    async def get_text(self, path: str, timeout_s: float = 5.0) -> str:
        text: str = await self._call("GET", path, None, timeout_s, as_text=True)
        return text

    async def post_json(self, path: str, payload: dict[str, Any] | None = None,
                        timeout_s: float = 5.0) -> Any:
        return await self._call("POST", path, payload or {}, timeout_s)

    # -- the rest of the interface ------------------------------------------------------------
    async def capacity(self) -> KVCapacity:
        if self.kv_tokens <= 0:
            raise UpstreamError(
                f"the KV capacity of {self.url} is unknown: a generic OpenAI-compatible engine "
                "cannot report it; give it as kv_tokens (e.g. --backend "
                "openai=URL,kv_tokens=500000)", unhealthy=False)
        return KVCapacity(self.kv_tokens, 0, self.page_tokens)

    async def health(self) -> bool:
        for path in ("/health", "/v1/models"):
            try:
                async with self.session.get(self.url + path,
                                            timeout=aiohttp.ClientTimeout(total=3.0)) as r:
                    if r.status == 200:
                        return True
            except (aiohttp.ClientError, TimeoutError):
                return False
        return False

    load_gauges: tuple[str, str] | None = None
    """The Prometheus gauges (requests running, requests waiting) this engine's
    ``/metrics`` reports, or None (a plain OpenAI-compatible server reports none)."""

    async def load(self) -> EngineLoad | None:
        """The engine's load from its ``/metrics`` (``load_gauges``); None if it has no
        such gauges or does not answer."""
        if self.load_gauges is None:
            return None
        try:
            text = await self.get_text("/metrics", timeout_s=3.0)
        except UpstreamError:
            return None
        return load_from_metrics(text, *self.load_gauges)

    async def models(self) -> list[dict[str, Any]]:
        data = await self.get_json("/v1/models")
        rows = data.get("data", []) if isinstance(data, dict) else []
        return [m for m in rows if isinstance(m, dict)]


def load_from_metrics(text: str, running: str, waiting: str) -> EngineLoad | None:
    """``EngineLoad`` from Prometheus text: the gauges ``running`` and ``waiting``, each
    summed over its label sets; None unless both have a reading (NaN, infinite and
    negative samples are left out)."""
    samples = parse_prometheus(text)
    counts: list[int] = []
    for name in (running, waiting):
        values = [v for _, v in samples.get(name, ()) if 0 <= v < math.inf]
        if not values:
            return None
        counts.append(int(sum(values)))
    return EngineLoad(*counts)
