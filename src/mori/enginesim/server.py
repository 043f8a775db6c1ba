"""The simulated engine as an OpenAI- and Anthropic-compatible HTTP server
(``mori engine-sim``).

``create_engine_sim_app(config)`` builds a Starlette app around one ``RealtimeReplica``
(``mori.sim.realtime``: the simulator's engine replica run against the wall clock,
time-scaled); ``start_engine_sim(config)`` serves it in the current event loop (the
gateway starts simulated replicas this way); ``mori engine-sim`` serves it standalone.

Endpoints
---------
- ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI), ``POST /v1/messages``
  (Anthropic, any query string such as ``?beta=true``), ``POST /v1/responses`` (OpenAI
  Responses): streaming (SSE) or not. How requests are read and prompts sized:
  ``mori.enginesim.calls``; what is answered: ``mori.enginesim.answers`` (placeholder
  text, or the config's ``script``); each API's body and stream:
  ``mori.enginesim.completions``, ``.messages``, ``.responses``. Reusable prefix:
  ``mori.reuse_tokens`` if given, else the program's previous context (prompt + output
  of its last request here) when the new prompt is at least that long (append-only
  conversations), else 0. A second request of a program while one runs is served as a
  one-shot program (the model runs one request per program at a time). Usage reports
  the prompt tokens found in the GPU or CPU tier (``cached_tokens``; Anthropic's
  ``cache_read_input_tokens``). The first token is sent when the simulated prefill ends;
  the rest as decode iterations complete; streams carry the ``: kv-ready`` comment when
  the KV is in place (``mori.enginesim.streams``). A client that disconnects aborts its
  request (out of the queue / batch, its KV unpinned). Errors come in the API's shape
  (OpenAI's, ``mori.protocol.errors``; Anthropic's on ``/v1/messages``): 400 bad input,
  404 unknown model, 503 queue full.
- ``POST /v1/messages/count_tokens`` -> ``{"input_tokens": n}``: the text rule
  (``mori.protocol.tokens``), no engine work.
- KV controls (JSON) under ``/mori/v1/``: ``POST programs/{pid}/label`` with
  ``{"label": "busy"|"idle"|"inactive"}``, ``POST programs/{pid}/offload`` (GPU pages
  to the CPU tier, or dropped without one), ``POST programs/{pid}/drop`` (both tiers),
  ``POST programs/{pid}/release`` (the program ended). Each answers the program's state
  ``{"program_id", "gpu_tokens", "cpu_tokens", "label", "pinned"}``; offload and drop
  answer 404 for a program the engine does not know. A running request's pages are
  pinned: offload and drop leave them. ``GET residency`` -> ``{"gpu_tokens": {pid: n},
  "cpu_tokens": {pid: n}}``; ``GET capacity`` -> ``{"gpu_tokens", "cpu_tokens",
  "page_tokens", "kv_bytes_per_token"}``; ``GET stats`` -> the replica's counters.
- ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus text, ``mori_engine_*``,
  ``mori.enginesim.metrics``).

With a ``token`` (``mori engine-sim --token``; the engines ``mori serve`` starts always
have a random one, known only to the gateway), every request but ``GET /health`` must
carry it (``Authorization: Bearer TOKEN``, or ``x-api-key: TOKEN``): without it, 401.
Every error is JSON in the API's shape, unknown paths (404) and methods (405) included.
"""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mori.core.types import KVLabel
from mori.enginesim.answers import Api
from mori.enginesim.calls import Call, check_body, check_model, parse_call, prompt_sizes
from mori.enginesim.completions import ChatStream, completion_body
from mori.enginesim.messages import MessagesStream, anthropic_error, message_body
from mori.enginesim.metrics import EngineCollector
from mori.enginesim.responses import ResponsesStream, response_body
from mori.enginesim.streams import SSE_HEADERS, Outcome, Render, stream_answer, wait_answer
from mori.protocol.errors import RequestError, clip
from mori.protocol.fields import CHAT, COMPLETIONS, COUNT_TOKENS, MESSAGES, RESPONSES
from mori.protocol.responses import (
    JSON_ERROR_HANDLERS,
    EventStream,
    api_error_response,
    error_response,
    spec_for_path,
)
from mori.protocol.serve import RunningServer, serve_app
from mori.sim.realtime import EngineSimConfig, RealtimeReplica, Track

__all__ = ["EngineSimConfig", "EngineSimServer", "create_engine_sim_app", "start_engine_sim"]

def _openai_error(e: RequestError) -> Response:
    return e.response()


@dataclass(frozen=True, slots=True)
class _Shape:
    """How one API answers: its request ids, its errors, its body and its stream."""

    api: Api
    id_prefix: str
    error: Callable[[RequestError], Response]
    body: Callable[[Call, Track, str, int], dict[str, Any]]
    stream: Callable[[Call, Track, str, int], Render]


_SHAPES = {
    Api.CHAT: _Shape(Api.CHAT, "chatcmpl-", _openai_error, completion_body, ChatStream),
    Api.COMPLETIONS: _Shape(Api.COMPLETIONS, "cmpl-", _openai_error, completion_body,
                            ChatStream),
    Api.MESSAGES: _Shape(Api.MESSAGES, "msg_", anthropic_error,
                         lambda c, t, rid, _: message_body(c, t, rid),
                         lambda c, t, rid, _: MessagesStream(c, t, rid)),
    Api.RESPONSES: _Shape(Api.RESPONSES, "resp_", _openai_error, response_body,
                          ResponsesStream),
}


async def _json_body(request: Request) -> Any:
    """The request's JSON; ``RequestError`` (400) for a body that is none."""
    try:
        return await request.json()
    except (ValueError, RecursionError):  # bad JSON or UTF-8, huge ints, deep nesting
        raise RequestError(400, "the request body is not valid JSON") from None


class _Api:
    """The HTTP handlers of one app (state lives here, not in module globals)."""

    def __init__(self, engine: RealtimeReplica) -> None:
        self.engine = engine
        self.created = int(time.time())

    # -- generation -------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._answer(request, _SHAPES[Api.CHAT])

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, _SHAPES[Api.COMPLETIONS])

    async def messages(self, request: Request) -> Response:
        return await self._answer(request, _SHAPES[Api.MESSAGES])

    async def responses(self, request: Request) -> Response:
        return await self._answer(request, _SHAPES[Api.RESPONSES])

    async def _answer(self, request: Request, shape: _Shape) -> Response:
        eng = self.engine
        try:
            body = await _json_body(request)
            call = parse_call(shape.api, body, request.headers, eng.model_name,
                              eng.config.script)
            track = eng.submit(call.program_id, call.prompt, call.answer.tokens, call.reuse)
        except RequestError as e:
            return shape.error(e)
        rid = shape.id_prefix + uuid.uuid4().hex
        created = int(time.time())
        if call.stream:
            return EventStream(200, SSE_HEADERS,
                               stream_answer(eng, track, shape.stream(call, track, rid, created)))
        outcome = await wait_answer(eng, track, request.receive)
        if outcome is Outcome.CLIENT_GONE:
            return shape.error(RequestError(499, "the client closed the request",
                                            code="client_closed",
                                            type_="invalid_request_error"))
        if outcome is Outcome.ABORTED:
            return shape.error(RequestError(503, "the engine aborted the request (shutting "
                                            "down)", code="aborted", type_="server_error"))
        return JSONResponse(shape.body(call, track, rid, created))

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's token counting: the text rule, no engine work."""
        try:
            body = check_body(await _json_body(request))
            check_model(body, self.engine.model_name, required=True)
            return JSONResponse({"input_tokens": prompt_sizes(COUNT_TOKENS, body)[0]})
        except RequestError as e:
            return anthropic_error(e)

    # -- info -------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        eng = self.engine
        return JSONResponse({"object": "list", "data": [{
            "id": eng.model_name, "object": "model", "created": self.created,
            "owned_by": "mori-engine-sim",
            "max_model_len": eng.preset.model.context_window}]})

    # -- KV controls ------------------------------------------------------------------
    async def label(self, request: Request) -> Response:
        pid = request.path_params["pid"]
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            return error_response(400, "the request body is not valid JSON")
        raw = body.get("label") if isinstance(body, dict) else None
        try:
            label = KVLabel(raw if isinstance(raw, str) else "")
        except ValueError:
            return error_response(400, f"label must be one of {[v.value for v in KVLabel]}",
                                  "label")
        self.engine.set_label(pid, label)
        return JSONResponse(self.engine.program_state(pid))

    async def offload(self, request: Request) -> Response:
        return self._control(request, self.engine.offload)

    async def drop(self, request: Request) -> Response:
        return self._control(request, self.engine.drop)

    async def release(self, request: Request) -> Response:
        pid = request.path_params["pid"]
        self.engine.release(pid)
        return JSONResponse(self.engine.program_state(pid))

    def _control(self, request: Request, action: Callable[[str], None]) -> Response:
        pid = request.path_params["pid"]
        self.engine.sync()
        if not self.engine.known(pid):
            return error_response(404, f"the engine holds no KV of program {clip(pid)!r}",
                                  "program_id", "program_not_found")
        action(pid)
        return JSONResponse(self.engine.program_state(pid))

    async def residency(self, request: Request) -> Response:
        return JSONResponse(self.engine.residency())

    async def capacity(self, request: Request) -> Response:
        return JSONResponse(self.engine.capacity())

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.engine.stats())

    async def metrics(self, request: Request) -> Response:
        registry: CollectorRegistry = request.app.state.metrics_registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class TokenGate:
    """ASGI middleware: every HTTP request but ``GET /health`` must carry ``token``
    (``Authorization: Bearer TOKEN`` or ``x-api-key: TOKEN``, compared in constant time);
    others are answered 401 in the API's shape."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        if not token or token != token.strip() or any(c.isspace() for c in token):
            raise ValueError("an engine token must be non-empty and contain no whitespace")
        self.app = app
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["path"] == "/health"
                                       and scope["method"] in ("GET", "HEAD")) \
                or self._allowed(scope["headers"]):
            await self.app(scope, receive, send)
            return
        resp = api_error_response(
            spec_for_path(scope["path"]), 401, "this engine takes requests only with its "
            "token: send 'Authorization: Bearer TOKEN' (the engine's --token or "
            "MORI_ENGINE_TOKEN)", None, "invalid_token", type_="authentication_error")
        resp.headers["WWW-Authenticate"] = "Bearer"
        await resp(scope, receive, send)

    def _allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        given = b""
        for k, v in headers:
            if k == b"authorization":
                scheme, _, rest = v.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    given = rest.strip()
            elif k == b"x-api-key" and not given:
                given = v.strip()
        return hmac.compare_digest(given, self._token)


def create_engine_sim_app(config: EngineSimConfig, *, token: str | None = None
                          ) -> Starlette:
    """A Starlette app serving one simulated engine replica (see the module doc);
    ``token``: the token every request but ``GET /health`` must carry (None: none).

    ``app.state.engine`` is its ``RealtimeReplica``; the clock starts with the app's
    lifespan (or its first request)."""
    engine = RealtimeReplica(config)
    api = _Api(engine)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    progs = "/mori/v1/programs/{pid:path}"
    routes = [
        Route(CHAT, api.chat, methods=["POST"]),
        Route(COMPLETIONS, api.completions, methods=["POST"]),
        Route(MESSAGES, api.messages, methods=["POST"]),
        Route(COUNT_TOKENS, api.count_tokens, methods=["POST"]),
        Route(RESPONSES, api.responses, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route(progs + "/label", api.label, methods=["POST"]),
        Route(progs + "/offload", api.offload, methods=["POST"]),
        Route(progs + "/drop", api.drop, methods=["POST"]),
        Route(progs + "/release", api.release, methods=["POST"]),
        Route("/mori/v1/residency", api.residency, methods=["GET"]),
        Route("/mori/v1/capacity", api.capacity, methods=["GET"]),
        Route("/mori/v1/stats", api.stats, methods=["GET"]),
    ]
    middleware = [Middleware(TokenGate, token=token)] if token is not None else None
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers=dict(JSON_ERROR_HANDLERS))
    app.state.engine = engine
    app.state.metrics_registry = registry
    return app


@dataclass(eq=False)
class EngineSimServer:
    """A simulated engine served in the current event loop: ``url`` is its base URL,
    ``engine`` its model, ``token`` the token it requires (None: none); ``await stop()``
    ends it (idempotent)."""

    engine: RealtimeReplica
    server: RunningServer
    token: str | None = None

    @property
    def url(self) -> str:
        return self.server.url

    async def stop(self) -> None:
        self.engine.abort_all()  # end streams now rather than after the graceful timeout
        await self.server.stop()


async def start_engine_sim(config: EngineSimConfig, host: str = "127.0.0.1",
                           port: int = 0, *, token: str | None = None) -> EngineSimServer:
    """Serve a simulated engine replica in the current event loop (``port`` 0: any free
    port), requiring ``token`` if given. ``OSError`` when the address cannot be used."""
    app = create_engine_sim_app(config, token=token)
    engine = app.state.engine
    assert isinstance(engine, RealtimeReplica)
    return EngineSimServer(engine, await serve_app(app, host, port), token)
