"""``mori dynamo-router``: MORI's control loop as a router service inside NVIDIA Dynamo.

This is the only module of MORI that imports Dynamo; it runs in Dynamo's environment
(``scripts/dynamo_cpu_env.sh`` builds one). It serves ``{namespace}.mori_router.generate``
and registers it as the public model (``--model-name``), so Dynamo's frontend hands every
tokenized chat request to it; it forwards each turn with Dynamo's ``KvRouter`` to the
worker MORI chose (``mori.dynamo.turn_handler``). ``{namespace}.mori_router.status``
answers the router's slots, counts and programs.

What it reads of Dynamo (``DynamoFleet``, every ``refresh_s``): the live workers of the
backend endpoint (its client's instance ids) into MORI's replica slots
(``mori.dynamo.fleet.WorkerSlots``), each worker's KV capacity from the model card it
published, and the requests Dynamo counts on each (``KvRouter.get_potential_loads``). A
worker that leaves discovery marks its replica down at once; the policy places its
programs on the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mori.dynamo.fleet import WorkerSlots, active_requests, capacity_of, tier_overlaps
from mori.dynamo.replica import DynamoReplica
from mori.dynamo.turn_handler import RouterError, TurnHandler
from mori.engines.base import KVCapacity
from mori.gateway.app import policy_for
from mori.gateway.config import GatewaySettings
from mori.gateway.control import Controller
from mori.gateway.metrics import GatewayMetrics

log = logging.getLogger("mori.dynamo")

COMPONENT = "mori_router"


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """One ``mori dynamo-router`` process. ``endpoint``: the workers' Dynamo endpoint
    (``namespace.component.endpoint``); ``model_name``/``model_path``: the public model
    the router registers and its tokenizer; ``workers``: MORI's replica slots (0: as many
    workers as are up at start); ``block_size``: the workers' KV block size;
    ``host_tokens``: each worker's host tier in tokens where its card does not say
    (None: the card's, else none); ``startup_wait_s``: how long to wait for the first
    worker and its card; ``refresh_s``: how often the workers are read;
    ``settings``: the control loop's (policy and its knobs, hold bounds)."""

    endpoint: str
    model_name: str
    model_path: str
    settings: GatewaySettings
    workers: int = 0
    block_size: int = 16
    host_tokens: int | None = None
    startup_wait_s: float = 120.0
    refresh_s: float = 0.5

    @property
    def namespace(self) -> str:
        return self.endpoint.split(".")[0]

    def check(self) -> None:
        parts = self.endpoint.split(".")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"--endpoint must be namespace.component.endpoint (e.g. "
                             f"dynamo.backend.generate), got {self.endpoint!r}")
        if self.workers < 0 or self.block_size < 1:
            raise ValueError("--workers must be 0 or more and --block-size at least 1")
        if self.host_tokens is not None and self.host_tokens < 0:
            raise ValueError("--host-tokens must be 0 or more")


class DynamoFleet:
    """What the router knows of the workers (``mori.dynamo.replica.FleetView``)."""

    def __init__(self, client: Any, cards: Any, kv_router: Any, slots: WorkerSlots,
                 config: RouterConfig) -> None:
        self.client = client
        self.cards = cards
        self.kv_router = kv_router
        self.slots = slots
        self.config = config
        self.capacities: dict[int, KVCapacity] = {}
        self.loads: dict[int, int] = {}
        self.card_errors: dict[int, str] = {}
        self.unplaced: list[int] = []  # live workers without a slot, as last said

    def live_ids(self) -> list[int]:
        try:
            return [int(i) for i in self.client.instance_ids()]
        except Exception as e:
            log.debug("instance ids unread: %s", e)
            return []

    def read_cards(self) -> None:
        try:
            cards = self.cards.get_model_cards()
        except Exception as e:
            log.debug("model cards unread: %s", e)
            return
        for key, body in cards.items():
            try:
                wid = int(key)
            except (TypeError, ValueError):
                continue
            if wid in self.capacities:
                continue
            try:
                cap = capacity_of(json.loads(body), self.config.host_tokens)
            except (ValueError, TypeError) as e:  # CardError, or a card that is not JSON
                self._card_error(wid, f"worker {wid}: {e}")
                continue
            if cap.page_tokens != self.config.block_size:
                msg = (f"worker {wid} uses KV blocks of {cap.page_tokens} tokens, the router "
                       f"--block-size {self.config.block_size}: give the router "
                       f"--block-size {cap.page_tokens}")
                self._card_error(wid, msg)
                continue
            self.capacities[wid] = cap

    def _card_error(self, wid: int, msg: str) -> None:
        if self.card_errors.get(wid) != msg:  # said once, not on every refresh
            log.error("%s", msg)
            self.card_errors[wid] = msg

    async def read_loads(self) -> None:
        try:
            self.loads = active_requests(await self.kv_router.get_potential_loads([0]))
        except Exception as e:
            log.debug("loads unread: %s", e)

    # -- FleetView --------------------------------------------------------------------
    def worker(self, slot: int) -> int | None:
        return self.slots.worker(slot)

    def capacity(self, slot: int) -> KVCapacity | None:
        wid = self.slots.worker(slot)
        if wid is not None and wid in self.capacities:
            return self.capacities[wid]
        # an empty slot is sized like the others (the policy takes replicas as identical)
        return next(iter(self.capacities.values()), None)

    def active(self, slot: int) -> int | None:
        wid = self.slots.worker(slot)
        return None if wid is None else self.loads.get(wid)


async def wait_for_workers(fleet: DynamoFleet, config: RouterConfig) -> list[int]:
    """The workers up with a usable card, once there are ``config.workers`` of them (or,
    for 0, at least one and no more joining for a second). Raises ``RuntimeError`` after
    ``startup_wait_s``."""
    deadline = time.monotonic() + config.startup_wait_s
    want = config.workers
    stable: list[int] = []
    stable_since = time.monotonic()
    while True:
        fleet.read_cards()
        ready = sorted(w for w in fleet.live_ids() if w in fleet.capacities)
        if ready != stable:
            stable, stable_since = ready, time.monotonic()
        if want and len(ready) >= want:
            return ready
        if not want and ready and time.monotonic() - stable_since >= 1.0:
            return ready
        if time.monotonic() >= deadline:
            if ready and want:
                log.warning("only %d of %d workers up after %.0f s: starting with them",
                            len(ready), want, config.startup_wait_s)
                return ready
            errors = "; ".join(sorted(set(fleet.card_errors.values())))
            raise RuntimeError(
                f"no worker of {config.endpoint} with a KV capacity in {config.startup_wait_s:.0f} "
                "s: start the workers first (the same namespace, discovery backend and "
                "request plane as the router: DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE)"
                + (f"; {errors}" if errors else ""))
        await asyncio.sleep(0.25)


async def refresh_loop(fleet: DynamoFleet, ctl: Controller, replicas: list[DynamoReplica],
                       period_s: float) -> None:
    """Keep the slots, the cards and the loads up to date; a worker that left (or whose
    slot a new worker took from a failing one) marks its replica down at once."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await refresh(fleet, ctl, replicas)
        except Exception:  # a bug here must not stop the router following its workers
            log.exception("reading the workers failed")


async def refresh(fleet: DynamoFleet, ctl: Controller, replicas: list[DynamoReplica]) -> None:
    fleet.read_cards()
    live = [w for w in fleet.live_ids() if w in fleet.capacities]
    failing = [w for r in replicas if (w := r.failing) is not None]
    for change in fleet.slots.update(live, failing):
        if change.previous is not None:
            why = ("its requests failed and a new worker took its place"
                   if change.worker_id is not None else "it left Dynamo's discovery")
            ctl.replicas.mark_unhealthy(change.slot, f"worker {change.previous}: {why}")
        if change.worker_id is not None:
            log.info("replica %d: worker %d", change.slot, change.worker_id)
            ctl.replicas.probe_soon(change.slot)
    unplaced = fleet.slots.unplaced(live)
    if unplaced and unplaced != fleet.unplaced:
        log.warning("workers %s have no slot (--workers %d): they get no programs",
                    unplaced, fleet.slots.size)
    fleet.unplaced = unplaced
    await fleet.read_loads()


def dynamo_error(e: RouterError) -> Exception:
    """The Dynamo exception the frontend turns into ``e``'s HTTP answer: bad input is
    ``InvalidArgument`` (400, its message kept); the rest ``HttpError`` with its status."""
    from dynamo.llm.exceptions import HttpError, InvalidArgument  # type: ignore[import-not-found]

    if e.status == 400:
        return InvalidArgument(e.message)  # type: ignore[no-any-return]
    return HttpError(e.status, e.message)  # type: ignore[no-any-return]


async def serve(runtime: Any, config: RouterConfig) -> None:
    """Run the router on ``runtime`` (a Dynamo ``DistributedRuntime``) until cancelled."""
    from dynamo.llm import (  # type: ignore[import-not-found]
        FpmEventSubscriber,
        KvRouter,
        KvRouterConfig,
        ModelInput,
        ModelType,
        WorkerType,
        register_model,
    )

    backend = runtime.endpoint(config.endpoint)
    kv_router = KvRouter(endpoint=backend, block_size=config.block_size,
                         kv_router_config=KvRouterConfig())
    client = await backend.client()
    cards = FpmEventSubscriber(backend)
    cards.start_tracking()
    probe = DynamoFleet(client, cards, kv_router, WorkerSlots(1), config)
    ready = await wait_for_workers(probe, config)
    slots = WorkerSlots(config.workers or len(ready))
    slots.update(ready)
    fleet = DynamoFleet(client, cards, kv_router, slots, config)
    fleet.capacities, fleet.card_errors = probe.capacities, probe.card_errors
    replicas = [DynamoReplica(config.endpoint, i, fleet, time.monotonic)
                for i in range(slots.size)]
    capacities = [await r.capacity() for r in replicas]
    policy = policy_for(config.settings, capacities)
    ctl = Controller(policy, list(replicas), GatewayMetrics(), config.settings)
    for i in range(slots.size):
        if slots.worker(i) is None:
            ctl.replicas.mark_unhealthy(i, "no worker yet")

    async def overlaps(tokens: list[int]) -> Any:
        return tier_overlaps(await kv_router.get_overlap_scores(tokens))

    async def forward(request: dict[str, Any]) -> AsyncIterator[Any]:
        return await kv_router.generate_from_request(request)  # type: ignore[no-any-return]

    handler = TurnHandler(ctl, slots, replicas, forward, overlaps,
                          config.settings.max_program_id_bytes,
                          max_prompt_tokens=min(c.gpu_tokens for c in capacities))

    async def generate(request: dict[str, Any]) -> AsyncIterator[Any]:
        try:
            async for chunk in handler.handle(request):
                yield chunk
        except RouterError as e:
            log.info("turn refused (%d): %s", e.status, e.message)
            raise dynamo_error(e) from None

    async def status(request: Any = None) -> AsyncIterator[Any]:
        yield handler.status()

    ctl.start()
    refresher = asyncio.create_task(refresh_loop(fleet, ctl, replicas, config.refresh_s))
    generate_ep = runtime.endpoint(f"{config.namespace}.{COMPONENT}.generate")
    status_ep = runtime.endpoint(f"{config.namespace}.{COMPONENT}.status")
    await register_model(model_input=ModelInput.Tokens,
                         model_type=ModelType.Chat | ModelType.Completions,
                         endpoint=generate_ep, model_path=config.model_path,
                         model_name=config.model_name, worker_type=WorkerType.Aggregated)
    log.info("MORI router up: policy %s, %d replica(s) (workers %s), GPU KV %d tokens and "
             "host %d each; serving %s as model %s", config.settings.policy, slots.size,
             slots.workers, capacities[0].gpu_tokens, capacities[0].cpu_tokens,
             f"{config.namespace}.{COMPONENT}.generate", config.model_name)
    try:
        await asyncio.gather(generate_ep.serve_endpoint(generate, graceful_shutdown=True),
                             status_ep.serve_endpoint(status, graceful_shutdown=True))
    finally:
        refresher.cancel()
        await ctl.stop()
        cards.shutdown()


def run(config: RouterConfig) -> int:
    """Start Dynamo's runtime (its discovery backend and request plane from the
    ``DYN_*`` environment) and serve until interrupted."""
    config.check()
    try:
        import uvloop
        from dynamo.runtime import DistributedRuntime, dynamo_worker  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(f"Dynamo is not installed in this Python ({e}): run the router "
                           "in Dynamo's environment (scripts/dynamo_cpu_env.sh builds one; "
                           "pip install ai-dynamo on a GPU host)") from None

    @dynamo_worker()  # type: ignore[untyped-decorator]
    async def main(runtime: DistributedRuntime) -> None:
        await serve(runtime, config)

    uvloop.run(main())
    return 0
