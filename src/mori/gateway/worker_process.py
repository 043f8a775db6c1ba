"""A gateway worker process (``mori serve --workers N``): completions served here, the
policy consulted in the policy process (``mori.gateway.worker_pool``).

The worker serves the connections the policy process hands it (``mori.gateway.handoff``:
they arrive on a socket pair whose end the worker inherits). Completions run the same
path as in the policy process (``mori.gateway.endpoint`` and ``mori.gateway.proxy``),
with the controller replaced by ``RemoteAdmitter``: admission is a round trip to the
policy process, and the lease's events (KV ready, an engine failure, the step's end) are
sent there as they happen. The worker forwards to the engines itself, through its own
adapters (built from the same backend specs, used for forwarding only). Every other
endpoint (programs, decisions, metrics, ...) is passed on to the policy process
(``passthrough``: keys checked and the body bounded before anything is read). The served
models that ``--model-alias`` maps onto are the policy process's list
(``WorkerGateway.refresh_models`` asks it; it sends the list at ``hello`` and on every
change), so a name resolves alike in every process. Connections are served within the
same bounds as in the policy process (``mori.gateway.bounds``). The worker's metric
increments are sent to the policy process twice a second, so ``/metrics`` counts every
process.

Run by the policy process (``worker_pool.spawn_worker``) as
``python -m mori.gateway.worker_process``, with a ``WorkerSpec`` as JSON on standard input.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mori.core.policy import PolicyConfig
from mori.engines.base import EngineAdapter, UpstreamError
from mori.engines.http import OpenAIHTTPAdapter
from mori.engines.registry import parse_backend
from mori.gateway.agents import RequestFacts, StepFacts
from mori.gateway.aliases import ModelAliases
from mori.gateway.auth import Access, KeyRing
from mori.gateway.bounds import ConnectionBounds, ConnectionGuard
from mori.gateway.config import GatewaySettings
from mori.gateway.endpoint import (
    ClientGone,
    CompletionEndpoint,
    GatewayApp,
    read_body,
    unauthorized,
)
from mori.gateway.handoff import Served, protocol_factory, take_connections
from mori.gateway.held import AdmissionRejected
from mori.gateway.ipc import FrameTooLarge, LinkClosed, WorkerLink, frame_limit
from mori.gateway.lease import warm_up
from mori.gateway.metrics import WORKER_TALLIES
from mori.gateway.token_ratio import TokenRatio
from mori.gateway.worker_pool import WorkerSpec
from mori.protocol.errors import RequestError
from mori.protocol.fields import anonymous_program_id
from mori.protocol.responses import error_response, request_error_response

log = logging.getLogger("mori.gateway")

FLUSH_S = 0.5
_HOP_HEADERS = frozenset(("host", "content-length", "connection", "transfer-encoding"))
_NOT_PASSED_BACK = frozenset(("content-length", "connection", "transfer-encoding",
                              "keep-alive", "content-encoding", "date", "server", "vary"))
"""Headers of the policy process's answer a worker does not pass on: the connection's
own, and the browser policy's (``vary``, ``access-control-*``), which the worker's app
adds itself."""
_NO_BODY = frozenset(("GET", "HEAD", "OPTIONS"))


class _Tally:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0.0

    def inc(self, n: float = 1.0) -> None:
        self.n += n


class _Labeled:
    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[tuple[str, ...], _Tally] = {}

    def labels(self, *key: str) -> _Tally:
        c = self.children.get(key)
        if c is None:
            c = self.children[key] = _Tally()
        return c


class _Samples:
    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, v: float) -> None:
        self.values.append(v)


class WorkerMetrics:
    """The metric names the completion path updates, tallied until ``take()`` (which
    zeroes them in place: the endpoint keeps its labelled children)."""

    _TALLIES = WORKER_TALLIES

    def __init__(self) -> None:
        self.requests = _Labeled()
        self.disconnects = _Tally()
        self.stream_timeouts = _Tally()
        self.prompt_tokens = _Tally()
        self.completion_tokens = _Tally()
        self.upstream_idle_timeouts = _Tally()
        self.sse_lines_too_long = _Tally()
        self.usage_clamped = _Tally()
        self.responses_too_large = _Tally()
        self.ttft = _Samples()

    def take(self) -> dict[str, Any] | None:
        """The increments since the last call (None: nothing happened), zeroed."""
        reqs = [[p, s, int(c.n)] for (p, s), c in self.requests.children.items() if c.n]
        out: dict[str, Any] = {"op": "counts", "requests": reqs, "ttft": self.ttft.values}
        for name in self._TALLIES:
            out[name] = getattr(self, name).n
        if not reqs and not self.ttft.values and not any(out[k] for k in self._TALLIES):
            return None
        for c in self.requests.children.values():
            c.n = 0.0
        for name in self._TALLIES:
            getattr(self, name).n = 0.0
        self.ttft.values = []
        return out


class RemoteLease:
    """A request admitted by the policy process: its events go back there."""

    def __init__(self, link: WorkerLink, rid: int, program_id: str, prompt_tokens: int,
                 adapter: EngineAdapter, priority: int, reloaded: bool) -> None:
        self._link = link
        self._rid = rid
        self.program_id = program_id
        self.prompt_tokens = prompt_tokens
        self._adapter = adapter
        self._priority = priority
        self._reloaded = reloaded
        self._done = False
        self._kv_ready = False
        self._answering = False

    @property
    def adapter(self) -> EngineAdapter:
        return self._adapter

    @property
    def priority(self) -> int:
        return self._priority

    def _send(self, msg: dict[str, Any]) -> None:
        msg["id"] = self._rid
        with contextlib.suppress(LinkClosed):
            self._link.send(msg)

    async def prepare(self, path: str, body: dict[str, Any], stream: bool) -> None:
        # the policy process waited for the replica's earlier KV controls before "go"
        if await warm_up(self._adapter, self.program_id, self._reloaded, path, body, stream):
            self.kv_ready()

    def kv_ready(self) -> None:
        if not self._done and not self._kv_ready:
            self._kv_ready = True
            self._send({"op": "kv_ready"})

    def answering(self) -> None:
        if not self._done and not self._answering:
            self._answering = True
            self._send({"op": "first"})

    def failed(self, e: UpstreamError) -> None:
        self._send({"op": "failed", "message": e.message, "unhealthy": e.unhealthy,
                    "status": e.status})

    def finish(self, context_tokens: int, step: StepFacts | None = None) -> None:
        if not self._done:
            self._done = True
            self._send({"op": "finish", "context": context_tokens,
                        "step": None if step is None else step.as_msg()})


class RemoteAdmitter:
    """Admission by the policy process (the worker's ``ctl``)."""

    def __init__(self, link: WorkerLink, adapters: list[EngineAdapter]) -> None:
        self.link = link
        self.adapters = adapters
        self._loop = asyncio.get_running_loop()

    def wall(self) -> float:
        return self._loop.time()

    async def lease(self, program_id: str, prompt_tokens: int, anonymous: bool = False,
                    facts: RequestFacts | None = None) -> RemoteLease:
        rid = self.link.next_id()
        try:
            ans = await self.link.call({"op": "admit", "id": rid, "pid": program_id,
                                        "tokens": prompt_tokens, "anon": anonymous,
                                        "facts": None if facts is None else facts.as_msg()})
        except LinkClosed:
            raise AdmissionRejected(503, "the gateway's policy process is unavailable; retry later",
                                    5.0) from None
        except FrameTooLarge as e:  # refused before it was sent: the link goes on
            raise AdmissionRejected(413, f"the request is too large to admit: {e}; lower its "
                                    "size (or raise --max-body-bytes)") from None
        except BaseException:  # the client left while its request waited
            with contextlib.suppress(LinkClosed):
                self.link.send({"op": "abandon", "id": rid})
            raise
        if ans["op"] == "reject":
            raise AdmissionRejected(int(ans["status"]), str(ans["message"]), ans.get("retry_after"))
        return RemoteLease(self.link, rid, program_id, prompt_tokens,
                           self.adapters[int(ans["replica"])], int(ans["priority"]),
                           bool(ans["reloaded"]))


class WorkerGateway:
    """A worker's gateway state (``mori.gateway.interfaces.Serving``); its served models
    are the policy process's (``set_models``, ``refresh_models``)."""

    def __init__(self, settings: GatewaySettings, adapters: list[EngineAdapter],
                 link: WorkerLink, gpu_tokens: int) -> None:
        self.settings = settings
        self.adapters = adapters
        self.keys = KeyRing(settings.api_keys, settings.admin_keys)
        self.metrics = WorkerMetrics()
        self.models: list[dict[str, Any]] = []
        self.model_ids: frozenset[str] = frozenset()
        self.aliases = ModelAliases.parse(settings.model_aliases)
        self.token_ratio = TokenRatio()
        self.link = link
        self._ctl = RemoteAdmitter(link, adapters)
        self._gpu_tokens = gpu_tokens

    @property
    def ctl(self) -> RemoteAdmitter:
        return self._ctl

    def gpu_tokens(self) -> int:
        return self._gpu_tokens

    def anonymous_id(self) -> str:
        return anonymous_program_id()

    def set_models(self, models: Any) -> None:
        """The policy process's list of served models (an empty one changes nothing)."""
        if isinstance(models, list) and models:
            rows = [m for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)]
            self.models, self.model_ids = rows, frozenset(m["id"] for m in rows)

    async def refresh_models(self) -> None:
        """Ask the policy process to read the engines' models again, and take its list."""
        with contextlib.suppress(LinkClosed):
            self.set_models((await self.link.call({"op": "models"})).get("models"))

    def on_message(self, msg: dict[str, Any]) -> None:
        """A message of the policy process's own (``WorkerLink.on_message``)."""
        op = msg.get("op")
        if op == "models":
            self.set_models(msg.get("models"))
        elif op == "abort" and 0 <= int(msg.get("replica", -1)) < len(self.adapters):
            # the policy process gave up on a replica: end this worker's requests there too
            self.adapters[int(msg["replica"])].abort_requests(str(msg.get("reason", "")))


def passthrough(policy_url: str, session: aiohttp.ClientSession, gw: WorkerGateway) -> Route:
    """A route passing every other request to the policy process's listener, and its
    answer back as it came (its headers too, but the connection's own).

    Nothing is read before the checks: with keys set, a request other than ``GET``,
    ``HEAD`` or ``OPTIONS`` without a valid key is answered 401 at once (every such route of the policy
    process needs a key); a body is then read within ``max_body_bytes`` (413 beyond:
    the connection's bounds, ``mori.gateway.bounds``, refuse a larger ``Content-Length``
    before this runs, and count a chunked body) and passed on."""

    async def handle(request: Request) -> Response:
        if request.method not in _NO_BODY and gw.keys.enabled and gw.keys.identify(
                request.headers.get("authorization")).access is Access.NONE:
            return unauthorized()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        try:
            body = await read_body(request.receive, request.headers.get("content-length"),
                                   gw.settings.max_body_bytes)
        except RequestError as e:
            return request_error_response(None, e)
        except ClientGone:
            return Response(status_code=499)  # nobody to answer: never sent
        url = policy_url + request.url.path + (f"?{request.url.query}" if request.url.query
                                               else "")
        try:
            async with session.request(request.method, url, data=body or None,
                                       headers=headers) as r:
                data = await r.read()
                keep = {k: v for k, v in r.headers.items() if k.lower() not in
                        _NOT_PASSED_BACK and not k.lower().startswith("access-control-")}
                return Response(data, status_code=r.status, headers=keep)
        except aiohttp.ClientError as e:
            return error_response(503, "the policy process is unavailable: "
                                  f"{type(e).__name__}", type_="api_error")

    return Route("/{path:path}", handle, methods=["GET", "POST", "PUT", "DELETE", "PATCH"])


async def _flush(gw: WorkerGateway) -> None:
    while True:
        await asyncio.sleep(FLUSH_S)
        counts = gw.metrics.take()
        if counts is not None:
            with contextlib.suppress(LinkClosed):
                gw.link.send(counts)


async def serve_worker(spec: WorkerSpec) -> None:
    settings = GatewaySettings(**{**spec.settings,
                                  "policy_config": PolicyConfig(**spec.settings["policy_config"]),
                                  "api_keys": tuple(spec.settings["api_keys"]),
                                  "admin_keys": tuple(spec.settings["admin_keys"])})
    link = await WorkerLink.connect(spec.ipc_path, frame_limit(settings.max_body_bytes))
    adapters = [parse_backend(b).build() for b in spec.backends]
    for a in adapters:
        a.first_byte_timeout_s = settings.first_byte_timeout_s
        a.max_response_bytes = settings.max_response_bytes
        # forwarding (and tokenize) only: no KV-event subscription here
        await OpenAIHTTPAdapter.start(a)  # type: ignore[arg-type]
    hello = await link.call({"op": "hello", "worker": str(spec.worker)})
    gw = WorkerGateway(settings, adapters, link, int(hello["gpu_tokens"]))
    gw.set_models(hello.get("models"))
    link.on_message = gw.on_message
    # its pooled connections to the policy process's listener are let go before that
    # listener's keep-alive timeout would close them under a request
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(
        keepalive_timeout=min(15.0, settings.keep_alive_timeout_s / 2)))

    @contextlib.asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        flush = asyncio.create_task(_flush(gw))
        try:
            yield
        finally:
            flush.cancel()
            await session.close()
            for a in adapters:
                with contextlib.suppress(Exception):
                    await a.close()
            await link.close()

    endpoint = CompletionEndpoint(gw)
    app = GatewayApp(endpoint, routes=[passthrough(spec.policy_url, session, gw)],
                     lifespan=lifespan)
    line = socket.socket(fileno=spec.line_fd)
    guard = ConnectionGuard(ConnectionBounds.of(settings))  # as in the policy process
    server = uvicorn.Server(uvicorn.Config(app, log_level=spec.log_level, access_log=False,
                                           proxy_headers=False, lifespan="on",
                                           **guard.uvicorn_options()))
    serve = asyncio.create_task(server.serve(sockets=[]))  # connections come on the line
    while not server.started and not serve.done():
        await asyncio.sleep(0.01)
    if server.started:
        take_connections(line, Served(protocol_factory(server)))
    closed = asyncio.create_task(_wait_closed(link))
    await asyncio.wait({serve, closed}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True  # the policy process went away: so does this worker
    await serve


async def _wait_closed(link: WorkerLink) -> None:
    while not link.closed:
        await asyncio.sleep(0.5)


def main() -> None:
    spec = WorkerSpec.from_json(sys.stdin.read())
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {spec.worker}]: "
                        "%(message)s")
    with contextlib.suppress(KeyboardInterrupt):
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvicorn[standard] brings it
            asyncio.run(serve_worker(spec))
        else:
            uvloop.run(serve_worker(spec))


if __name__ == "__main__":
    main()


__all__ = ["RemoteAdmitter", "RemoteLease", "WorkerGateway", "WorkerMetrics", "main",
           "serve_worker"]
