"""The gateway's HTTP app: ``create_app(settings, adapters)`` (no globals).

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions`` (streaming and not),
``GET /v1/models``, ``GET /v1/programs``, ``GET /v1/programs/{id}``,
``POST /v1/programs/{id}/release``, ``GET /v1/decisions`` (the recent decision log),
``GET /v1/residency`` (per replica: where the policy placed programs, and where the
engine reports their KV, for engines that report it),
``GET /healthz`` and ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES
from mori.core.policy import Policy, PolicyConfig
from mori.engines.base import (
    Capability,
    EngineAdapter,
    KVCapacity,
    NotSupportedError,
    RequestHints,
    UpstreamError,
)
from mori.gateway.control import Admission, Controller, ControllerSettings, GateRejected
from mori.gateway.errors import RequestError, error_response, sse_error
from mori.gateway.metrics import GatewayMetrics
from mori.gateway.parsing import (
    CHAT,
    COMPLETIONS,
    ClientRequest,
    StreamWatcher,
    estimate_prompt_tokens,
    parse_request,
    usage_tokens,
)

log = logging.getLogger("mori.gateway")


@dataclass(slots=True)
class GatewaySettings:
    """What the app needs to know (the CLI maps flags and config files onto this)."""

    policy: str = "mori"
    tick_s: float = 5.0
    idleness_window: int = 5
    binary_threshold: float = 0.5
    time_scale: float = 1.0
    max_gated: int = 1024
    gate_timeout_s: float = 300.0
    retry_after_s: float = 5.0
    program_ttl_s: float = 3600.0
    max_body_bytes: int = 32 * 1024 * 1024
    health_interval_s: float = 2.0
    exact_tokens: bool = False  # ask engines that can count prompt tokens exactly
    decision_log: int = 10000
    startup_wait_s: float = 60.0  # how long to wait for engines that are still starting

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; valid: {', '.join(POLICIES.names())}")
        for name in ("tick_s", "time_scale", "gate_timeout_s", "health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.max_gated < 1:
            raise ValueError(f"max_gated must be >= 1 (got {self.max_gated})")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024 (got {self.max_body_bytes})")


def build_policy(settings: GatewaySettings, capacities: list[KVCapacity]) -> Policy:
    """The registered policy, sized from the replicas' reported capacities.

    Replicas are scheduled as identical (the policy's model): the smallest capacity is
    used for all of them.
    """
    cls = POLICIES.get(settings.policy)
    page = capacities[0].page_tokens
    kvb = capacities[0].kv_bytes_per_token
    gpu_tokens = min(c.gpu_tokens for c in capacities)
    cpu_tokens = min(c.cpu_tokens for c in capacities)
    gpu_bytes = gpu_tokens // page * page * kvb
    cpu_bytes = cpu_tokens // page * page * kvb
    cluster = ClusterSpec(len(capacities), gpu_bytes, cpu_bytes)
    return cls(cluster, kvb, PolicyConfig(tick_s=settings.tick_s,
                                          idleness_window=settings.idleness_window,
                                          binary_threshold=settings.binary_threshold,
                                          page_tokens=page))


class Gateway:
    """State of one app: adapters, the policy (built at startup), the controller."""

    def __init__(self, settings: GatewaySettings, adapters: list[EngineAdapter]) -> None:
        if not adapters:
            raise ValueError("the gateway needs at least one engine replica")
        self.settings = settings
        self.adapters = adapters
        self.metrics = GatewayMetrics()
        self.controller: Controller | None = None
        self.capacities: list[KVCapacity] = []
        self.models: list[dict[str, Any]] = []
        self.model_ids: frozenset[str] = frozenset()
        self._anon = itertools.count(1)

    @property
    def ctl(self) -> Controller:
        if self.controller is None:
            raise RuntimeError("the gateway has not started")
        return self.controller

    async def prepare(self) -> None:
        """Connect to the engines, read their capacities, build the policy. Raises
        ``RuntimeError`` saying what is wrong (the engines are closed again then)."""
        if self.controller is not None:
            return
        try:
            await self._prepare()
        except BaseException:
            await self.shutdown()
            raise

    async def startup(self) -> None:
        await self.prepare()
        assert self.controller is not None
        self.controller.start()
        log.info("gateway up: policy %s, %d replica(s), GPU KV %d tokens each",
                 self.settings.policy, len(self.adapters),
                 min(c.gpu_tokens for c in self.capacities))

    async def _prepare(self) -> None:
        for a in self.adapters:
            await a.start()
        self.capacities = await self._wait_for_capacities()
        if len({c.page_tokens for c in self.capacities}) > 1:
            raise RuntimeError("the replicas use different KV page sizes: "
                               f"{[c.page_tokens for c in self.capacities]}")
        policy = build_policy(self.settings, self.capacities)
        s = self.settings
        self.controller = Controller(policy, self.adapters, self.metrics, ControllerSettings(
            time_scale=s.time_scale, max_gated=s.max_gated, gate_timeout_s=s.gate_timeout_s,
            retry_after_s=s.retry_after_s, program_ttl_s=s.program_ttl_s,
            health_interval_s=s.health_interval_s, decision_log=s.decision_log))
        self.metrics.watch(self._state)
        await self.refresh_models()

    async def _wait_for_capacities(self) -> list[KVCapacity]:
        """Each replica's capacity; engines still starting get ``startup_wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.startup_wait_s
        next_note = loop.time()
        while True:
            try:
                return list(await asyncio.gather(*(a.capacity() for a in self.adapters)))
            except UpstreamError as e:
                if not e.unhealthy or loop.time() >= deadline:
                    raise RuntimeError(f"cannot read an engine's KV capacity: {e.message}"
                                       ) from e
                if loop.time() >= next_note:  # say so now and then, not on every try
                    log.info("waiting up to %.0f s more for the engines to start: %s",
                             deadline - loop.time(), e.message)
                    next_note = loop.time() + 10.0
                await asyncio.sleep(0.5)

    async def shutdown(self) -> None:
        if self.controller is not None:
            await self.controller.stop()
        for a in self.adapters:
            with contextlib.suppress(Exception):
                await a.close()

    async def refresh_models(self) -> None:
        seen: dict[str, dict[str, Any]] = {}
        for a in self.adapters:
            with contextlib.suppress(UpstreamError, Exception):
                for m in await a.models():
                    if isinstance(m.get("id"), str):
                        seen.setdefault(m["id"], m)
        if seen:
            self.models = list(seen.values())
            self.model_ids = frozenset(seen)

    def _state(self) -> dict[str, Any]:
        ctl = self.controller
        if ctl is None:
            return {"programs": {}, "gated": 0, "replicas": []}
        counts: dict[tuple[str, str], int] = {}
        for p in ctl.policy.programs.values():
            key = (p.tier.value, p.status.value)
            counts[key] = counts.get(key, 0) + 1
        place = ctl.policy.placement
        rows = []
        for i, r in enumerate(ctl.replicas):
            gpu = place.gpu[i]
            cpu = place.cpu[i]
            rows.append({
                "running_requests": r.in_flight, "healthy": 1 if r.healthy else 0,
                "gpu_programs": len(gpu.members), "cpu_programs": len(cpu.members),
                "gpu_kv_used_ratio": gpu.used / gpu.capacity if gpu.capacity else 0.0,
            })
        return {"programs": counts, "gated": ctl.gated_count(), "replicas": rows}

    def gpu_tokens(self) -> int:
        return min(c.gpu_tokens for c in self.capacities)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the request body ({declared} bytes) exceeds the gateway's "
                           f"limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the request body exceeds the gateway's limit of "
                               f"{limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(settings: GatewaySettings, adapters: list[EngineAdapter]) -> Starlette:
    """The gateway app in front of ``adapters`` (one per engine replica)."""
    gw = Gateway(settings, adapters)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    async def completions(request: Request) -> Response:
        endpoint = request.url.path
        try:
            raw = await _read_body(request, settings.max_body_bytes)
            req = parse_request(endpoint, raw, request.headers.get("x-program-id"))
        except RequestError as e:
            gw.metrics.requests.labels(endpoint, str(e.status)).inc()
            return e.response()
        except ClientDisconnect:
            return Response(status_code=499)
        resp = await _serve(gw, req)
        gw.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    async def models(request: Request) -> Response:
        if not gw.models:
            await gw.refresh_models()
        return JSONResponse({"object": "list", "data": gw.models})

    async def programs(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": gw.ctl.describe_all()})

    async def program(request: Request) -> Response:
        pid = request.path_params["program_id"]
        d = gw.ctl.describe(pid)
        if d is None:
            return error_response(404, f"no program {pid!r} is known to the gateway",
                                  "program_id", "program_not_found")
        return JSONResponse(d)

    async def release(request: Request) -> Response:
        pid = request.path_params["program_id"]
        if not gw.ctl.release(pid):
            return error_response(404, f"no program {pid!r} is known to the gateway",
                                  "program_id", "program_not_found")
        return JSONResponse({"program_id": pid, "released": True})

    async def decisions(request: Request) -> Response:
        try:
            since = float(request.query_params.get("since", "-inf"))
        except ValueError:
            return error_response(400, "'since' must be a number (policy seconds)", "since")
        rows = [d.as_dict() for d in gw.ctl.log if d.time >= since]
        return JSONResponse({"object": "list", "data": rows})

    async def residency(request: Request) -> Response:
        """Where each replica's engine says each program's KV is (engines that report it),
        beside where the policy placed it."""
        ctl = gw.ctl
        rows = []
        for i, r in enumerate(ctl.replicas):
            row: dict[str, Any] = {"replica": i, "url": r.adapter.url,
                                   "policy_gpu": sorted(ctl.policy.placement.gpu[i].members),
                                   "policy_cpu": sorted(ctl.policy.placement.cpu[i].members)}
            if r.adapter.supports(Capability.RESIDENCY):
                try:
                    res = await r.adapter.residency()
                    row["engine_gpu_tokens"] = dict(res.gpu_tokens)
                    row["engine_cpu_tokens"] = dict(res.cpu_tokens)
                except (UpstreamError, NotSupportedError) as e:
                    row["error"] = str(e)
            rows.append(row)
        return JSONResponse({"object": "list", "data": rows})

    async def healthz(request: Request) -> Response:
        ctl = gw.ctl
        healthy = [r.healthy for r in ctl.replicas]
        body = {"status": "ok" if any(healthy) else "degraded", "policy": settings.policy,
                "replicas": [{"url": r.adapter.url, "kind": r.adapter.kind,
                              "healthy": r.healthy, "last_error": r.last_error}
                             for r in ctl.replicas]}
        return JSONResponse(body, status_code=200 if any(healthy) else 503)

    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [
        Route(CHAT, completions, methods=["POST"]),
        Route(COMPLETIONS, completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/programs", programs, methods=["GET"]),
        Route("/v1/programs/{program_id:path}/release", release, methods=["POST"]),
        Route("/v1/programs/{program_id:path}", program, methods=["GET"]),
        Route("/v1/decisions", decisions, methods=["GET"]),
        Route("/v1/residency", residency, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gw
    return app


async def _serve(gw: Gateway, req: ClientRequest) -> Response:
    ctl = gw.ctl
    if gw.model_ids and req.model not in gw.model_ids:
        await gw.refresh_models()
        if req.model not in gw.model_ids:
            return error_response(404, f"the model {req.model!r} does not exist; served: "
                                  + ", ".join(m["id"] for m in gw.models), "model",
                                  "model_not_found")
    anonymous = req.program_id is None
    pid = req.program_id or f"anon-{next(gw._anon)}"
    tokens = await _prompt_tokens(gw, req)
    if tokens > gw.gpu_tokens():
        return error_response(400, f"the prompt ({tokens} tokens) does not fit the GPU KV "
                              f"capacity of one replica ({gw.gpu_tokens()} tokens)",
                              "messages", "context_length_exceeded")
    arrived = ctl.wall()
    try:
        adm = await ctl.admit(pid, tokens, anonymous)
    except GateRejected as e:
        return error_response(e.status, e.message, "program_id", None, e.retry_after_s)
    replica = ctl.replicas[adm.replica]
    adapter = replica.adapter
    if not replica.healthy:
        ctl.finished(pid, tokens)
        return error_response(503, f"replica {adm.replica} ({adapter.url}) is unhealthy: "
                              f"{replica.last_error}; retry later", None, None,
                              gw.settings.retry_after_s)
    await ctl.controls_done(adm.replica)
    await _maybe_prefetch(gw, adm, req, pid)
    pol = ctl.policy.programs.get(pid)
    rank = min(10, int(pol.iota(ctl.now()) * 10)) if pol is not None else 0
    hints = RequestHints(pid, priority=rank, synthetic=req.synthetic)
    replica.in_flight += 1
    try:
        up = await adapter.forward(req.path, req.body, req.stream, hints)
    except UpstreamError as e:
        replica.in_flight -= 1
        gw.metrics.upstream_errors.labels(str(adm.replica)).inc()
        if e.unhealthy:
            ctl.mark_unhealthy(adm.replica, e.message)
        ctl.finished(pid, tokens)
        return error_response(e.status, e.message, None, None,
                              gw.settings.retry_after_s if e.status == 503 else None)
    except BaseException:
        replica.in_flight -= 1
        ctl.finished(pid, tokens)
        raise
    if up.chunks is None:
        replica.in_flight -= 1
        gw.metrics.ttft.observe(ctl.wall() - arrived)
        body = up.body or b""
        p_used, c_used = usage_tokens(body) if up.status == 200 else (None, 0)
        prompt = p_used if p_used is not None and req.synthetic is None else tokens
        gw.metrics.prompt_tokens.inc(prompt)
        gw.metrics.completion_tokens.inc(c_used or 0)
        ctl.finished(pid, prompt + (c_used or 0))
        return Response(body, status_code=up.status, headers=up.headers)
    return _EventStream(up.status, up.headers,
                        _relay(gw, up.chunks, up.aclose, pid, tokens, req, adm.replica, arrived))


class _EventStream(Response):
    """An SSE response passed through chunk by chunk; a client that goes away cancels it.

    Lighter than Starlette's ``StreamingResponse`` (no task group per request): one
    task pumps the chunks, the handler's own task watches for the disconnect.
    """

    def __init__(self, status: int, headers: dict[str, str],
                 chunks: AsyncGenerator[bytes, None]) -> None:
        self.status_code = status
        self.chunks = chunks
        self.background = None
        hdrs = {k.lower(): v for k, v in headers.items()}
        hdrs.setdefault("content-type", "text/event-stream")
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in hdrs.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        try:
            while not pump.done():
                watch = asyncio.ensure_future(receive())
                await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not watch.done():
                    watch.cancel()
                    break
                if watch.result().get("type") == "http.disconnect":
                    pump.cancel()
                    break
        finally:
            if not pump.done():
                pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def _pump(self, send: Send) -> None:
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.chunks.aclose()


async def _relay(gw: Gateway, chunks: AsyncIterator[bytes], aclose: Any, pid: str,
                 tokens: int, req: ClientRequest, replica: int, arrived: float
                 ) -> AsyncGenerator[bytes, None]:
    ctl = gw.ctl
    watcher = StreamWatcher()
    first = True
    try:
        async for chunk in chunks:
            if first:
                gw.metrics.ttft.observe(ctl.wall() - arrived)
                first = False
            watcher.feed(chunk)
            yield chunk
    except UpstreamError as e:
        gw.metrics.upstream_errors.labels(str(replica)).inc()
        if e.unhealthy:
            ctl.mark_unhealthy(replica, e.message)
        yield sse_error(502, e.message)
    except (asyncio.CancelledError, GeneratorExit):
        gw.metrics.disconnects.inc()
        raise
    finally:
        ctl.replicas[replica].in_flight -= 1
        with contextlib.suppress(Exception):
            await aclose()
        prompt = tokens
        if watcher.prompt_tokens is not None and req.synthetic is None:
            prompt = watcher.prompt_tokens
        out = watcher.output_tokens()
        gw.metrics.prompt_tokens.inc(prompt)
        gw.metrics.completion_tokens.inc(out)
        ctl.finished(pid, prompt + out)


async def _prompt_tokens(gw: Gateway, req: ClientRequest) -> int:
    if req.synthetic is not None and "prompt_tokens" in req.synthetic:
        return max(1, int(req.synthetic["prompt_tokens"]))
    if gw.settings.exact_tokens:
        for a in gw.adapters:
            if a.supports(Capability.TOKENIZE):
                with contextlib.suppress(UpstreamError, Exception):
                    n = await a.count_prompt_tokens(req.path, req.body)
                    if n is not None:
                        return max(1, n)
                break
    return estimate_prompt_tokens(req)


async def _maybe_prefetch(gw: Gateway, adm: Admission, req: ClientRequest, pid: str) -> None:
    adapter = gw.ctl.replicas[adm.replica].adapter
    if adm.reloaded and adapter.supports(Capability.PREFETCH):
        try:
            await adapter.prefetch(pid, req.path, dict(req.body))
        except Exception as e:  # a failed warm-up only costs the reload it tried to hide
            log.info("prefetch for %s failed: %s", pid, e)

