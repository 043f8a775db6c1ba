"""The gateway's HTTP app: ``create_app(settings, adapters)`` (no globals).

Endpoints (the route table: ``Routes.table``):

- the model calls, ``POST`` (``CompletionEndpoint``, ``mori.gateway.endpoint``; every
  API of ``mori.protocol.apis``): ``/v1/chat/completions`` and ``/v1/completions``
  (OpenAI's, streaming and not), ``/v1/messages`` (Anthropic's Messages) and
  ``/v1/messages/count_tokens`` (its token counting), ``/v1/responses`` (OpenAI's
  Responses), and the Gemini API's methods under ``/v1beta/models/`` and ``/v1/models/``
  (``MODEL:generateContent``, ``:streamGenerateContent``, ``:countTokens``);
- ``GET /v1/models``; ``GET /v1/programs`` (a page at a time), ``GET /v1/programs/{id}``,
  ``POST /v1/programs/{id}/release``;
- ``GET /v1/decisions`` (the recent decision log), ``GET /v1/residency`` (per replica:
  where the policy placed programs, and where the engine reports their KV, for engines
  that report it), ``GET /v1/replicas`` (per replica: health, load, the engine's learned
  prices);
- ``GET /healthz``, ``GET /metrics``;
- the dashboard: ``GET /dashboard`` (the page) and ``GET /dashboard/state`` (what it
  shows; admin only), see ``mori.gateway.dashboard``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mori.core.ledger import ClusterSpec
from mori.core.policies import build_policy
from mori.core.policy import DEFAULT_LOAD_WINDOW_S, Policy
from mori.core.types import Capability, Tier
from mori.engines.base import EngineAdapter, KVCapacity, NotSupportedError, UpstreamError
from mori.gateway.aliases import ModelAliases
from mori.gateway.auth import Access, KeyRing, Principal
from mori.gateway.config import GatewaySettings
from mori.gateway.control import Controller
from mori.gateway.dashboard import STATE_PATH, LiveDashboard
from mori.gateway.endpoint import CompletionEndpoint, GatewayApp, unauthorized
from mori.gateway.metrics import GatewayMetrics, GatewayState, ReplicaRow, distributions
from mori.gateway.record import TraceRecorder
from mori.gateway.state import StateKeeper, load_state
from mori.gateway.token_ratio import TokenRatio
from mori.protocol.apis import API_BY_PATH
from mori.protocol.errors import clip
from mori.protocol.fields import anonymous_program_id
from mori.protocol.gemini.routes import PREFIXES as GEMINI_PREFIXES
from mori.protocol.responses import error_response
from mori.traces.errors import TraceError

log = logging.getLogger("mori.gateway")


def policy_for(settings: GatewaySettings, capacities: list[KVCapacity]) -> Policy:
    """The configured policy, sized from the replicas' reported capacities.

    Replicas are scheduled as identical (the policy's model): the smallest capacity is
    used for all of them.
    """
    page = capacities[0].page_tokens
    kvb = capacities[0].kv_bytes_per_token
    gpu_tokens = min(c.gpu_tokens for c in capacities)
    cpu_tokens = min(c.cpu_tokens for c in capacities)
    disk_tokens = min(c.disk_tokens for c in capacities)
    cluster = ClusterSpec(len(capacities), gpu_tokens // page * page * kvb,
                          cpu_tokens // page * page * kvb, disk_tokens // page * page * kvb)
    config = dataclasses.replace(settings.policy_config, page_tokens=page)
    if config.gpu_overcommit_period_s is None and settings.load_interval_s > 0:
        # the tier's size follows the engines' queues as read: four readings a look
        window = config.load_window_s or DEFAULT_LOAD_WINDOW_S
        config = dataclasses.replace(config, gpu_overcommit_period_s=max(
            window, OVERCOMMIT_READINGS * settings.load_interval_s * settings.time_scale))
    return build_policy(settings.policy, cluster, kvb, config)


OVERCOMMIT_READINGS = 4
"""Readings of the engines' load per look of an adaptive GPU tier (``mori_overcommit``)."""


def tier_tokens(policy: Policy, replica: int) -> dict[str, int | None]:
    """``replica``'s GPU tier as the policy fills it and the engine's pool, in tokens
    (None: not managed)."""
    kvb = policy.kv_bytes_per_token
    cap, pool = policy.gpu_capacity(replica), policy.pool_gpu_bytes
    return {"tokens": None if cap is None else cap // kvb,
            "pool_tokens": None if pool is None else pool // kvb}


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
        self.model_listeners: list[Callable[[list[dict[str, Any]]], None]] = []
        """Called with the served models whenever the list changes (the workers' hub)."""
        self._refreshing: set[asyncio.Task[None]] = set()
        self.keys = KeyRing(settings.api_keys, settings.admin_keys)
        self.aliases = ModelAliases.parse(settings.model_aliases)
        self.token_ratio = TokenRatio()
        self.dashboard = LiveDashboard(self)
        self.state_keeper: StateKeeper | None = None  # --state

    @property
    def ctl(self) -> Controller:
        if self.controller is None:
            raise RuntimeError("the gateway has not started")
        return self.controller

    def anonymous_id(self) -> str:
        return anonymous_program_id()

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
        self.ctl.replica_listeners.append(self._replica_changed)
        self.ctl.start()
        self.dashboard.start()
        if self.state_keeper is not None:
            self.state_keeper.start()
        log.info("gateway up: policy %s, %d replica(s), GPU KV %d tokens each",
                 self.settings.policy, len(self.adapters), self.gpu_tokens())

    async def _prepare(self) -> None:
        for a in self.adapters:
            await a.start()
        self.capacities = await self._wait_for_capacities()
        if len({c.page_tokens for c in self.capacities}) > 1:
            raise RuntimeError("the replicas use different KV page sizes: "
                               f"{[c.page_tokens for c in self.capacities]}")
        policy = policy_for(self.settings, self.capacities)
        self.controller = Controller(policy, self.adapters, self.metrics, self.settings)
        if self.settings.record is not None:
            try:
                self.controller.recording.recorder = TraceRecorder(
                    self.settings.record, keep_text=self.settings.record_text,
                    text_max_bytes=self.settings.record_text_max_bytes)
            except (TraceError, OSError) as e:
                raise RuntimeError(f"--record: {e}") from e
        self.metrics.watch(self.state)
        await self.refresh_models()
        histories = {}
        if self.settings.state is not None:
            saved = load_state(self.settings.state)
            if saved is not None:
                histories = saved.aged(time.time(), self.settings.time_scale)
            ctl = self.controller
            self.state_keeper = StateKeeper(
                self.settings.state, self.settings.state_interval_s,
                lambda: list(ctl.policy.histories(ctl.now())))
        # a restart: programs back to the KV they left (with their histories, if kept)
        await self.controller.restore(histories)

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
        await self.dashboard.stop()
        if self.state_keeper is not None:
            await self.state_keeper.stop()  # the last snapshot, before anything closes
            self.state_keeper = None
        if self.controller is not None:
            await self.controller.stop()
        for a in self.adapters:
            with contextlib.suppress(Exception):
                await a.close()

    def _replica_changed(self, replica: int, healthy: bool, why: str) -> None:
        """An engine that comes back may serve other models: read the list again."""
        if healthy:
            task = asyncio.get_running_loop().create_task(self.refresh_models())
            self._refreshing.add(task)
            task.add_done_callback(self._refreshing.discard)

    async def refresh_models(self) -> None:
        seen = await served_models(self.adapters)
        if seen and list(seen.values()) != self.models:
            self.models = list(seen.values())
            self.model_ids = frozenset(seen)
            for tell in self.model_listeners:
                tell(self.models)

    def state(self) -> GatewayState | None:
        """What ``/metrics`` reports of the current state (None before startup)."""
        ctl = self.controller
        if ctl is None:
            return None
        place = ctl.policy.placement
        rows = []
        for r in ctl.replicas.all:
            gpu, cpu = place.gpu[r.index], place.cpu[r.index]
            rows.append(ReplicaRow(
                running_requests=r.in_flight, healthy=r.healthy, gpu_programs=len(gpu.members),
                cpu_programs=len(cpu.members),
                gpu_kv_used_ratio=gpu.used / gpu.capacity if gpu.capacity else 0.0,
                engine_running=r.engine_load.running if r.engine_load else None,
                engine_waiting=r.engine_load.waiting if r.engine_load else None))
        counts = ctl.executor.counts
        now = ctl.now()
        idleness, context = distributions(
            (p.tier.value, p.idleness(now), p.tokens) for p in ctl.policy.programs.values())
        oldest = next(ctl.policy.held_since(now), None)
        return GatewayState(
            programs={(t.value, s.value): n for (t, s), n in ctl.policy.status_counts().items()},
            held=ctl.policy.held_count, replicas=rows,
            oldest_wait_s=(now - oldest.ready_at) / ctl.settings.time_scale if oldest else 0.0,
            promotions={t.value: counts.promotions[t] for t in Tier},
            demotions={t.value: counts.demotions[t]
                       for t in (Tier.CPU, Tier.DISK, Tier.NONE)
                       if t is not Tier.DISK or ctl.policy.cluster.disk_bytes},
            idleness=idleness, context=context)

    def gpu_tokens(self) -> int:
        return min(c.gpu_tokens for c in self.capacities)


async def served_models(adapters: list[EngineAdapter]) -> dict[str, dict[str, Any]]:
    """The models the replicas serve, by id (replicas that fail to answer are skipped)."""
    seen: dict[str, dict[str, Any]] = {}
    for a in adapters:
        with contextlib.suppress(UpstreamError, Exception):
            for m in await a.models():
                if isinstance(m.get("id"), str):
                    seen.setdefault(m["id"], m)
    return seen


PAGE_DEFAULT = 1000  # programs a /v1/programs page holds unless ?limit= says otherwise
PAGE_MAX = 10_000


class Routes:
    """The HTTP handlers of one gateway (the completions are ``CompletionEndpoint``'s).

    With keys configured (``mori.gateway.auth``): ``/v1/models`` needs a key;
    ``/v1/programs`` lists the caller's own programs (an admin key: every program, by the
    gateway's ids), a page at a time: ``?limit=N`` (1000 unless given, at most 10,000)
    ``&after=ID``, with ``has_more``, ``first_id`` and ``last_id`` as OpenAI's lists; and a program can be read or released only by its own key or an admin
    key; ``/v1/decisions``, ``/v1/residency``, ``/v1/replicas`` and ``/metrics`` (unless ``public_metrics``)
    need an admin key; ``/healthz`` is open but names the replicas only to an admin key
    (each with the error that made it unhealthy, null once it is healthy again).
    """

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.endpoint = CompletionEndpoint(gw)

    def table(self) -> list[Route]:
        return [
            *(Route(path, self.endpoint, methods=["POST"]) for path in API_BY_PATH),
            *(Route(prefix + "{rest:path}", self.endpoint, methods=["POST"])
              for prefix in GEMINI_PREFIXES),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/programs", self.programs, methods=["GET"]),
            Route("/v1/programs/{program_id:path}/release", self.release, methods=["POST"]),
            Route("/v1/programs/{program_id:path}", self.program, methods=["GET"]),
            Route("/v1/decisions", self.decisions, methods=["GET"]),
            Route("/v1/residency", self.residency, methods=["GET"]),
            Route("/v1/replicas", self.replicas, methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/dashboard", self.gw.dashboard.page_endpoint, methods=["GET"]),
            Route(STATE_PATH, self.gw.dashboard.state_endpoint(
                lambda request: self._denied(request, admin=True)), methods=["GET"]),
        ]

    def _principal(self, request: Request) -> Principal:
        return self.gw.keys.identify(request.headers.get("authorization"))

    def _denied(self, request: Request, admin: bool) -> Response | None:
        """The refusal for a caller without a key (401) or, where ``admin``, without an
        admin key (403); None when the caller may go on."""
        access = self._principal(request).access
        if access is Access.NONE:
            return unauthorized()
        if admin and access is not Access.ADMIN:
            return error_response(403, f"{request.url.path} needs an admin key (--admin-key)",
                                  None, "admin_key_required", type_="permission_error")
        return None

    async def models(self, request: Request) -> Response:
        if (denied := self._denied(request, admin=False)) is not None:
            return denied
        if not self.gw.models:
            await self.gw.refresh_models()
        return JSONResponse({"object": "list", "data": self.gw.models})

    def _own(self, principal: Principal, pid: str) -> str | None:
        """The gateway's id of ``pid`` as ``principal`` names it (an admin names every
        program by the gateway's id), None if the caller has no key."""
        if principal.access is Access.NONE:
            return None
        return pid if principal.access is Access.ADMIN else principal.internal(pid)

    async def programs(self, request: Request) -> Response:
        p = self._principal(request)
        if p.access is Access.NONE:
            return unauthorized()
        q = request.query_params
        try:
            limit = int(q.get("limit", str(PAGE_DEFAULT)))
            if not 1 <= limit <= PAGE_MAX:
                raise ValueError
        except ValueError:
            return error_response(400, f"'limit' must be an integer from 1 to {PAGE_MAX}",
                                  "limit")
        after = q.get("after")
        admin = p.access is Access.ADMIN
        if after is not None and not admin:
            after = p.internal(after)
        owner = None if admin else self.gw.ctl.quotas.owner_of(p.internal(""))
        rows, more = self.gw.ctl.describe_page(owner, after, limit)
        if not admin:
            rows = [mine for row in rows if (mine := _as_seen_by(p, row)) is not None]
        return JSONResponse({"object": "list", "data": rows, "has_more": more,
                             "first_id": rows[0]["program_id"] if rows else None,
                             "last_id": rows[-1]["program_id"] if rows else None})

    async def program(self, request: Request) -> Response:
        p = self._principal(request)
        pid = request.path_params["program_id"]
        internal = self._own(p, pid)
        if internal is None:
            return unauthorized()
        d = self.gw.ctl.describe(internal)
        if d is None:
            return _no_program(pid)
        return JSONResponse(d if p.access is Access.ADMIN else _as_seen_by(p, d))

    async def release(self, request: Request) -> Response:
        p = self._principal(request)
        pid = request.path_params["program_id"]
        internal = self._own(p, pid)
        if internal is None:
            return unauthorized()
        if not self.gw.ctl.release(internal):
            return _no_program(pid)
        return JSONResponse({"program_id": pid, "released": True})

    async def decisions(self, request: Request) -> Response:
        if (denied := self._denied(request, admin=True)) is not None:
            return denied
        try:
            since = float(request.query_params.get("since", "-inf"))
        except ValueError:
            return error_response(400, "'since' must be a number (policy seconds)", "since")
        rows = [r.as_dict() for r in self.gw.ctl.log.since(since)]
        return JSONResponse({"object": "list", "data": rows})

    async def replicas(self, request: Request) -> Response:
        """Per replica: health, load, the policy's busy and queue shares
        (``ReplicaLoad``), and the engine's prices as measured (``EnginePrices.view``)
        beside those the policy uses."""
        if (denied := self._denied(request, admin=True)) is not None:
            return denied
        ctl = self.gw.ctl
        rows = []
        now = ctl.now()
        for r in ctl.replicas.all:
            load = r.engine_load
            rows.append({"replica": r.index, "url": r.adapter.url, "kind": r.adapter.kind,
                         "healthy": r.healthy, "in_flight": r.in_flight,
                         "engine_load": None if load is None else
                         {"running": load.running, "waiting": load.waiting},
                         # the policy's recent shares: a step running, requests waiting
                         "shares": {"busy": ctl.policy.load.share(r.index, now),
                                    "queued": ctl.policy.load.queue_share(r.index, now)},
                         "costs": ctl.prices.view(r.index),
                         # the GPU tier the policy fills against the engine's pool
                         # (larger where it is overcommitted: --gpu-overcommit[-max])
                         "gpu_tier": tier_tokens(ctl.policy, r.index)})
        return JSONResponse({"object": "list", "data": rows})

    async def residency(self, request: Request) -> Response:
        """Where each replica's engine says each program's KV is (engines that report it),
        beside where the policy placed it."""
        if (denied := self._denied(request, admin=True)) is not None:
            return denied
        ctl = self.gw.ctl
        rows = []
        for r in ctl.replicas.all:
            row: dict[str, Any] = {"replica": r.index, "url": r.adapter.url,
                                   "policy_gpu": sorted(ctl.policy.placement.gpu[r.index].members),
                                   "policy_cpu": sorted(ctl.policy.placement.cpu[r.index].members)}
            if r.adapter.supports(Capability.RESIDENCY):
                try:
                    res = await r.adapter.residency()
                    row["engine_gpu_tokens"] = dict(res.gpu_tokens)
                    row["engine_cpu_tokens"] = dict(res.cpu_tokens)
                except (UpstreamError, NotSupportedError) as e:
                    row["error"] = str(e)
            rows.append(row)
        return JSONResponse({"object": "list", "data": rows})

    async def healthz(self, request: Request) -> Response:
        replicas = self.gw.ctl.replicas.all
        ok = any(r.healthy for r in replicas)
        body: dict[str, Any] = {"status": "ok" if ok else "degraded"}
        if self._principal(request).access is Access.ADMIN:
            body["policy"] = self.gw.settings.policy
            body["replicas"] = [{"url": r.adapter.url, "kind": r.adapter.kind,
                                 "healthy": r.healthy, "last_error": r.last_error or None,
                                 "in_flight": r.in_flight,
                                 "engine_load": (None if r.engine_load is None else
                                                 {"running": r.engine_load.running,
                                                  "waiting": r.engine_load.waiting})}
                                for r in replicas]
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        if not self.gw.settings.public_metrics \
                and (denied := self._denied(request, admin=True)) is not None:
            return denied
        return Response(self.gw.metrics.render(), media_type="text/plain; version=0.0.4")


def _as_seen_by(p: Principal, row: dict[str, Any]) -> dict[str, Any] | None:
    """A program's description with the ids (program, session, parent) as ``p`` names
    them; None if the program is another key's."""
    own = p.external(row["program_id"])
    if own is None:
        return None
    out = {**row, "program_id": own}
    for key in ("session", "parent"):
        if isinstance(out.get(key), str):
            out[key] = p.external(out[key])
    return out


def _no_program(pid: str) -> Response:
    return error_response(404, f"no program {clip(pid)!r} is known to the gateway", "program_id",
                          "program_not_found")


def create_app(settings: GatewaySettings, adapters: list[EngineAdapter]) -> GatewayApp:
    """The gateway app in front of ``adapters`` (one per engine replica)."""
    gw = Gateway(settings, adapters)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    routes = Routes(gw)
    app = GatewayApp(routes.endpoint, routes=routes.table(), lifespan=lifespan)
    app.state.gateway = gw
    return app
