"""The simulated engine as an OpenAI-compatible HTTP server (``mori engine-sim``).

``create_engine_sim_app(config)`` builds a Starlette app around one ``RealtimeEngine``
(``mori.engines.realtime``: the simulator's engine replica run against the wall clock,
time-scaled); ``start_engine_sim(config)`` serves it in the current event loop (the
gateway starts simulated replicas this way); ``mori engine-sim`` serves it standalone.

Endpoints
---------
- ``POST /v1/chat/completions``, ``POST /v1/completions``: streaming (SSE) or not. The
  engine generates exactly ``max_completion_tokens`` / ``max_tokens`` tokens (default
  16), placeholder words, one word per token. Prompt size: the ``mori`` field's
  ``prompt_tokens`` if the body has it, else ceil(characters / 4) of the text. Reusable
  prefix: ``mori.reuse_tokens`` if given, else the program's previous context (prompt +
  output of its last request here) when the new prompt is at least that long
  (append-only conversations), else 0. Program: header ``X-Program-Id``, else body
  ``program_id``, else a one-shot program per request. A second request of a program
  while one runs is served as a one-shot program (the model runs one request per
  program at a time). Usage reports ``prompt_tokens_details.cached_tokens`` (prompt
  tokens found in the GPU or CPU tier); streams include it in a last chunk with
  ``stream_options.include_usage``. The first token is sent when the simulated prefill
  ends; the rest as decode iterations complete. A client that disconnects aborts its
  request (out of the queue / batch, its KV unpinned). Errors come in OpenAI's shape
  ``{"error": {"message", "type", "param", "code"}}``: 400 bad input, 404 unknown model,
  503 queue full.
- KV controls (JSON) under ``/mori/v1/``: ``POST programs/{pid}/label`` with
  ``{"label": "busy"|"idle"|"inactive"}``, ``POST programs/{pid}/offload`` (GPU pages
  to the CPU tier, or dropped without one), ``POST programs/{pid}/drop`` (both tiers),
  ``POST programs/{pid}/release`` (the program ended). Each answers the program's state
  ``{"program_id", "gpu_tokens", "cpu_tokens", "label", "pinned"}``; offload and drop
  answer 404 for a program the engine does not know. A running request's pages are
  pinned: offload and drop leave them. ``GET residency`` -> ``{"gpu_tokens": {pid: n},
  "cpu_tokens": {pid: n}}``; ``GET capacity`` -> ``{"gpu_tokens", "cpu_tokens",
  "page_tokens", "kv_bytes_per_token"}``; ``GET stats`` -> the replica's counters.
- ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus text, ``mori_engine_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from mori.core.types import KVLabel
from mori.engines.realtime import (
    EngineSimConfig,
    RealtimeEngine,
    RequestError,
    Track,
    synthetic_sizes,
    text_prompt_tokens,
)

__all__ = [
    "EngineSimConfig",
    "RunningServer",
    "create_engine_sim_app",
    "serve_app",
    "start_engine_sim",
]

DEFAULT_MAX_TOKENS = 16
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit",
          "sed", "do", "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore",
          "magna", "aliqua")


def token_text(i: int) -> str:
    """The text of output token ``i``: one placeholder word, space-separated."""
    word = _WORDS[i % len(_WORDS)]
    return word if i == 0 else " " + word


def _error(status: int, message: str, type_: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status_code=status)


def _request_error(e: RequestError) -> JSONResponse:
    return _error(e.status, e.message, e.type, e.param, e.code)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _EventStream(StreamingResponse):
    """An SSE response that watches for the client going away whatever the server's ASGI
    version, and always closes its generator (whose ``finally`` aborts the request)."""

    def __init__(self, chunks: AsyncGenerator[bytes, None]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_t = asyncio.ensure_future(pump())
        watch_t = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_t, watch_t}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (pump_t, watch_t):
                t.cancel()
            results = await asyncio.gather(pump_t, watch_t, return_exceptions=True)
            await self.chunks.aclose()
        err = results[0]
        if isinstance(err, BaseException) and not isinstance(
                err, (asyncio.CancelledError, OSError)):
            raise err


@dataclass(frozen=True, slots=True)
class _Call:
    """One parsed completion request."""

    chat: bool
    model: str
    program_id: str | None
    prompt: int
    reuse: int | None
    output: int
    stream: bool
    include_usage: bool


def _parse(path: str, body: Any, headers: Mapping[str, str], model: str) -> _Call:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    chat = path.endswith("/chat/completions")
    asked = body.get("model")
    if asked is not None and asked != model:
        raise RequestError(f"The model `{asked}` does not exist.", status=404,
                           code="model_not_found", param="model")
    n = body.get("n", 1)
    if n not in (1, None):
        raise RequestError("only n = 1 is supported", param="n")
    output: Any = body.get("max_completion_tokens") if chat else None
    if output is None:
        output = body.get("max_tokens")
    if output is None:
        output = DEFAULT_MAX_TOKENS
    if isinstance(output, bool) or not isinstance(output, int) or output < 1:
        raise RequestError("max_tokens must be a positive integer", param="max_tokens")
    text_prompt = text_prompt_tokens(path, body)  # validates messages / prompt
    synthetic_prompt, reuse = synthetic_sizes(body)
    prompt = max(1, synthetic_prompt) if synthetic_prompt is not None else text_prompt
    pid = headers.get("x-program-id") or body.get("program_id")
    if pid is not None and (not isinstance(pid, str) or not pid):
        raise RequestError("program_id must be a non-empty string", param="program_id")
    stream = body.get("stream") is True
    opts = body.get("stream_options")
    include_usage = stream and isinstance(opts, dict) and opts.get("include_usage") is True
    return _Call(chat, model, pid, prompt, reuse, output, stream, include_usage)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Api:
    """The HTTP handlers of one app (state lives here, not in module globals)."""

    def __init__(self, engine: RealtimeEngine) -> None:
        self.engine = engine
        self.created = int(time.time())

    # -- completions ------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "/v1/chat/completions")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "/v1/completions")

    async def _complete(self, request: Request, path: str) -> Response:
        eng = self.engine
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON")
        try:
            call = _parse(path, body, request.headers, eng.model_name)
            track = eng.submit(call.program_id, call.prompt, call.output, call.reuse)
        except RequestError as e:
            return _request_error(e)
        rid = ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if call.stream:
            return _EventStream(self._stream(call, track, rid, created))
        done = asyncio.ensure_future(self._wait_done(track))
        gone = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (done, gone):
                t.cancel()
            await asyncio.gather(done, gone, return_exceptions=True)
            eng.abort(track)  # no-op once finished
        if track.finished_at is None:
            if gone.done() and not gone.cancelled():
                return _error(499, "the client closed the request", code="client_closed")
            return _error(503, "the engine aborted the request (shutting down)",
                          type_="server_error", code="aborted")
        text = "".join(token_text(i) for i in range(call.output))
        usage = _usage(call.prompt, call.output, track.cached_tokens)
        if call.chat:
            choice: dict[str, Any] = {
                "index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": call.model,
                             "choices": [choice], "usage": usage})

    @staticmethod
    async def _wait_done(track: Track) -> None:
        while not track.done:
            track.changed.clear()
            if track.done:
                return
            await track.changed.wait()

    async def _stream(self, call: _Call, track: Track, rid: str,
                      created: int) -> AsyncGenerator[bytes, None]:
        eng = self.engine
        obj = "chat.completion.chunk" if call.chat else "text_completion"
        min_wait = eng.config.min_emit_interval_s

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            data: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                    "model": call.model, "choices": choices}
            if call.include_usage:
                data["usage"] = usage
            return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

        def piece(i: int, finish: str | None = None) -> dict[str, Any]:
            text = token_text(i) if i >= 0 else ""
            if call.chat:
                delta: dict[str, Any] = {"content": text} if i >= 0 else {}
                if i == 0:
                    delta = {"role": "assistant", "content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        sent = 0
        try:
            while True:
                track.changed.clear()
                eng.sync()
                if track.aborted:  # by the engine (shutting down): say so, no [DONE]
                    yield b"data: " + json.dumps({"error": {
                        "message": "the engine aborted the request", "type": "server_error",
                        "param": None, "code": "aborted"}}).encode() + b"\n\n"
                    return
                due = eng.tokens_done(track)
                if due > sent:
                    yield b"".join(chunk([piece(i)]) for i in range(sent, due))
                    sent = due
                if track.finished_at is not None:
                    break
                nxt = eng.next_token_time(track)
                wait = None if nxt is None else max(eng.wall_delay(nxt), min_wait)
                await eng.wait_change(track, wait)
            tail = [chunk([piece(-1, "length")])]
            if call.include_usage:
                tail.append(chunk([], _usage(call.prompt, call.output, track.cached_tokens)))
            tail.append(b"data: [DONE]\n\n")
            yield b"".join(tail)
        finally:
            eng.abort(track)  # no-op once finished

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
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON")
        raw = body.get("label") if isinstance(body, dict) else None
        try:
            label = KVLabel(raw if isinstance(raw, str) else "")
        except ValueError:
            return _error(400, f"label must be one of {[v.value for v in KVLabel]}",
                          param="label")
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
            return _error(404, f"the engine holds no KV of program {pid!r}",
                          param="program_id", code="program_not_found")
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


class _EngineCollector(Collector):
    """Reads the engine's state at scrape time (one per app, no global registry)."""

    def __init__(self, engine: RealtimeEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        eng = self.engine
        eng.sync()
        st, c = eng.replica.stats, eng.counters
        model = [eng.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(model, value)
            return m

        yield gauge("mori_engine_requests_running", "Requests admitted (prefill, decode, "
                    "KV reload).", eng.running)
        yield gauge("mori_engine_requests_waiting", "Requests waiting for admission.",
                    eng.waiting)
        yield gauge("mori_engine_kv_usage_ratio", "Fraction of the GPU KV pool in use.",
                    eng.kv_usage())
        yield gauge("mori_engine_cpu_kv_usage_ratio", "Fraction of the CPU KV pool in use "
                    "(0 without one).", eng.cpu_kv_usage())
        cap = GaugeMetricFamily("mori_engine_kv_capacity_tokens", "KV pool size in tokens.",
                                labels=["model_name", "tier"])
        cap.add_metric([eng.model_name, "gpu"], eng.gpu_pages * eng.page)
        cap.add_metric([eng.model_name, "cpu"], eng.cpu_pages * eng.page)
        yield cap
        yield counter("mori_engine_prompt_tokens", "Prompt tokens of admitted requests.",
                      st.prompt_tokens)
        yield counter("mori_engine_prefix_hit_tokens", "Prompt tokens found in the KV cache "
                      "(GPU or CPU tier).", st.gpu_hit_tokens + st.cpu_hit_tokens)
        yield counter("mori_engine_cpu_hit_tokens", "Prompt tokens reloaded from the CPU "
                      "tier.", st.cpu_hit_tokens)
        yield counter("mori_engine_prefill_tokens", "Prompt tokens computed.",
                      st.prefill_tokens)
        yield counter("mori_engine_recomputed_tokens", "Reusable prompt tokens computed "
                      "again (their KV had been lost).", st.recomputed_tokens)
        yield counter("mori_engine_generation_tokens", "Output tokens generated.",
                      c.generation_tokens)
        yield counter("mori_engine_requests", "Requests submitted.", c.requests)
        yield counter("mori_engine_requests_finished", "Requests finished.", c.finished)
        yield counter("mori_engine_requests_aborted", "Requests aborted (client gone, shutdown).",
                      c.aborted)
        yield counter("mori_engine_evicted_gpu_tokens", "KV tokens evicted from the GPU.",
                      eng.pools.evicted_gpu_pages * eng.page)
        yield counter("mori_engine_busy_seconds", "Simulated seconds the engine computed.",
                      st.busy_s)


def create_engine_sim_app(config: EngineSimConfig) -> Starlette:
    """A Starlette app serving one simulated engine replica (see the module doc).

    ``app.state.engine`` is its ``RealtimeEngine``; the clock starts with the app's
    lifespan (or its first request)."""
    engine = RealtimeEngine(config)
    api = _Api(engine)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    progs = "/mori/v1/programs/{pid:path}"
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
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
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics_registry = registry
    return app


# -- serving in process ------------------------------------------------------------------

class _InProcessServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone (its host
    application owns them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass(eq=False)
class RunningServer:
    """An app served by uvicorn in the current event loop; ``await stop()`` ends it."""

    url: str
    host: str
    port: int
    app: Starlette
    server: uvicorn.Server
    task: asyncio.Task[None]

    async def stop(self) -> None:
        eng = getattr(self.app.state, "engine", None)
        if isinstance(eng, RealtimeEngine):
            eng.abort_all()  # end streams now rather than after the graceful timeout
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    @property
    def engine(self) -> RealtimeEngine:
        """The simulated engine (apps made by ``create_engine_sim_app``)."""
        eng = self.app.state.engine
        assert isinstance(eng, RealtimeEngine)
        return eng


async def serve_app(app: Starlette, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve ``app`` in the current event loop; ``port`` 0 picks a free port (reported in
    ``.url`` and ``.port``). Returns once the server accepts connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted sockets inherit it: no ~40 ms Nagle / delayed-ACK stall per response
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            lifespan="on", timeout_graceful_shutdown=2)
    server = _InProcessServer(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]),
                                                  name=f"uvicorn:{bound}")
    while not server.started:
        if task.done():
            sock.close()
            exc = task.exception()
            raise RuntimeError(f"the server on {host}:{bound} failed to start") from exc
        await asyncio.sleep(0.005)
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    netloc = f"[{shown}]" if ":" in shown else shown
    return RunningServer(f"http://{netloc}:{bound}", host, bound, app, server, task)


async def start_engine_sim(config: EngineSimConfig, host: str = "127.0.0.1",
                           port: int = 0) -> RunningServer:
    """Serve a simulated engine replica in the current event loop (``port`` 0: any free
    port). ``.url`` is its base URL, ``.engine`` its model, ``await .stop()`` ends it."""
    return await serve_app(create_engine_sim_app(config), host, port)
