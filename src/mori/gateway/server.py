"""Running the gateway: engines (given, or simulated in-process) + the app on uvicorn.

With no ``backends``, ``replicas`` simulated engines (``mori engine-sim``) start in this
process on free ports, sized by ``preset`` and shaped like the engine the policy
expects (a CPU tier of ``cpu_ratio`` x the GPU pool when the policy's engine has one;
typed eviction labels when it uses them): the embedded default a newcomer runs first.

Every connection is served within the bounds of ``mori.gateway.bounds`` (request head
and body limits and timeouts, keep-alive, a cap on open connections), in this process
and in each ``--workers`` worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import secrets
import socket
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from mori.core.policies import POLICIES
from mori.engines.base import EngineAdapter
from mori.engines.registry import parse_backend
from mori.gateway.app import Gateway, create_app
from mori.gateway.bounds import ConnectionBounds, ConnectionGuard
from mori.gateway.config import GatewaySettings
from mori.gateway.handoff import KEEP, Dealer, Served, protocol_factory
from mori.gateway.worker_pool import (
    WorkerHub,
    WorkerSpec,
    keep_workers,
    spawn_worker,
    stop_workers,
)
from mori.protocol.serve import bind_socket

log = logging.getLogger("mori.gateway")


@dataclass(slots=True)
class ServeConfig:
    """Everything ``mori serve`` takes (flags and config-file keys map onto it)."""

    host: str = "127.0.0.1"
    port: int = 8000
    backends: list[str] = field(default_factory=list)
    replicas: int = 1  # simulated replicas started when no backend is given
    preset: str = "h200-qwen3-30b-a3b"
    cpu_ratio: float = 1.0
    gpu_kv_tokens: int | None = None
    engine_script: Path | None = None  # the simulated engines' scripted answers
    log_level: str = "info"
    workers: int = 1  # gateway processes (1: the policy process alone)
    # with workers, the connections the policy process serves itself before handing new
    # ones on (mori.gateway.handoff; 0: every connection to a worker, as tests use)
    policy_connections: int = KEEP
    api_key_file: Path | None = None
    admin_key_file: Path | None = None
    allow_unauthenticated: bool = False
    label_secret_file: Path | None = None  # the engines' label secret (labels= backends)
    settings: GatewaySettings = field(default_factory=GatewaySettings)


async def start_simulated_backends(cfg: ServeConfig) -> tuple[list[EngineAdapter], list[Any]]:
    """Start ``cfg.replicas`` simulated engines in this process; their adapters and
    handles (``await handle.stop()``). Each engine requires a random token that only its
    adapter is given (``sim_backend_spec`` passes it on to ``--workers``), so other local
    users cannot read or drive it on its loopback port."""
    from mori.engines.simulated import SimEngineAdapter
    from mori.enginesim import EngineSimConfig, start_engine_sim
    from mori.sim.script import load_script

    profile = POLICIES.get(cfg.settings.policy).engine_profile
    script = load_script(cfg.engine_script) if cfg.engine_script is not None else None
    adapters: list[EngineAdapter] = []
    handles: list[Any] = []
    for _ in range(cfg.replicas):
        sim_cfg = EngineSimConfig(
            preset=cfg.preset, time_scale=cfg.settings.time_scale,
            cpu_ratio=cfg.cpu_ratio if profile.cpu_tier else 0.0,
            typed_eviction=profile.typed_eviction, gpu_kv_tokens=cfg.gpu_kv_tokens,
            script=script)
        token = secrets.token_urlsafe(32)
        h = await start_engine_sim(sim_cfg, host="127.0.0.1", port=0, token=token)
        handles.append(h)
        adapters.append(SimEngineAdapter(h.url, token=token))
    return adapters, handles


def sim_backend_spec(adapter: EngineAdapter) -> str:
    """The ``--backend`` spec of an embedded engine's adapter (its token included: the
    workers get it on their standard input, never on a command line)."""
    token = getattr(adapter, "token", None)
    return f"sim={adapter.url}" + (f",token={token}" if token else "")


GC_THRESHOLDS = (50_000, 50, 100)
"""The collector's thresholds while serving (Python's defaults: 700, 10, 10). Each
request allocates a few hundred objects, so the defaults run a young collection every
few requests and a full one every few thousand, which shows as tens of milliseconds in
the latency tail; with these, collections are rarer and the p99 stays near the p90
(``bench/bench_gateway.py``). Cycles are still collected."""


def tune_gc() -> None:
    """Freeze what startup allocated (the collector skips it from now on) and make
    collections rarer (``GC_THRESHOLDS``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def run_gateway(cfg: ServeConfig,
                      on_ready: Callable[[str], Awaitable[None] | None] | None = None,
                      stop: asyncio.Event | None = None) -> None:
    """Serve until cancelled (or ``stop`` is set). ``on_ready(url)`` is called once the
    gateway listens."""
    handles: list[Any] = []
    hub: WorkerHub | None = None
    procs: list[subprocess.Popen[bytes]] = []
    keeper: asyncio.Task[None] | None = None
    dealer: Dealer | None = None
    sock: socket.socket | None = None
    tmp = tempfile.TemporaryDirectory(prefix="mori-serve-")
    if cfg.backends:
        adapters = [parse_backend(b).build() for b in cfg.backends]
    else:
        adapters, handles = await start_simulated_backends(cfg)
    try:
        app = create_app(cfg.settings, adapters)
        await app.state.gateway.prepare()  # engine problems: one clear error, before serving
        tune_gc()
        try:
            sock = bind_socket(cfg.host, cfg.port)
            sockets = [sock]
            if cfg.workers > 1:  # the workers pass inspection requests to this listener
                sockets.append(bind_socket("127.0.0.1", 0))
        except OSError:
            await app.state.gateway.shutdown()  # close the adapters' HTTP sessions
            raise
        host, port = sock.getsockname()[:2]
        url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        # every connection within the bounds of mori.gateway.bounds (handed-over ones too)
        guard = ConnectionGuard(ConnectionBounds.of(cfg.settings))
        server = uvicorn.Server(uvicorn.Config(app, log_level=cfg.log_level, access_log=False,
                                               proxy_headers=False, lifespan="on",
                                               backlog=2048, **guard.uvicorn_options()))
        # with workers, this process accepts on the port itself (Dealer, below) and its
        # uvicorn listens only for what the workers pass on
        serve = asyncio.create_task(server.serve(sockets=sockets[-1:]))
        while not server.started and not serve.done():
            await asyncio.sleep(0.01)
        if serve.done():
            await serve  # startup failed: raise its error
            raise RuntimeError("the gateway stopped during startup (see the log above)")
        if cfg.workers > 1:
            backends = cfg.backends or [sim_backend_spec(a) for a in adapters]
            counted = app.state.gateway.metrics.connections
            dealer = Dealer(sock, Served(protocol_factory(server)), cfg.policy_connections,
                            on_dealt=lambda w: counted.labels(
                                "policy" if w == 0 else f"worker{w}").inc())
            hub, procs, restart = await start_workers(cfg, app.state.gateway, backends,
                                                      dealer, sockets[1].getsockname()[1],
                                                      tmp)
            keeper = asyncio.create_task(keep_workers(procs, restart))
            dealer.start()
        if on_ready is not None:
            r = on_ready(url)
            if r is not None:
                await r
        if stop is not None:
            waiter = asyncio.create_task(stop.wait())
            await asyncio.wait({serve, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            server.should_exit = True
        await serve
    finally:
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        if dealer is not None:
            dealer.stop()
        if hub is not None:
            await hub.stop()
        stop_workers(procs)
        if sock is not None:
            sock.close()
        tmp.cleanup()
        for h in handles:
            with contextlib.suppress(Exception):
                await h.stop()


async def start_workers(cfg: ServeConfig, gw: Gateway, backends: list[str], dealer: Dealer,
                        policy_port: int, tmp: tempfile.TemporaryDirectory[str]
                        ) -> tuple[WorkerHub, list[subprocess.Popen[bytes]],
                                   Callable[[int], subprocess.Popen[bytes]]]:
    """Start ``cfg.workers - 1`` worker processes, each on a new line from ``dealer``,
    and wait until each has connected to this process's hub (``RuntimeError`` if one
    does not). Returns the hub, the processes and how to start the i-th one again."""
    hub = WorkerHub(gw)
    path = os.path.join(tmp.name, "policy.sock")
    await hub.start(path)
    n = cfg.workers - 1

    def start(i: int) -> subprocess.Popen[bytes]:
        theirs = dealer.line(i + 1)
        try:
            return spawn_worker(WorkerSpec(i + 1, theirs.fileno(), path,
                                           f"http://127.0.0.1:{policy_port}", backends,
                                           dataclasses.asdict(cfg.settings), cfg.log_level))
        finally:
            theirs.close()  # the worker has its copy

    procs = [start(i) for i in range(n)]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60.0
    while hub.hellos < n:
        if any(p.poll() is not None for p in procs) or loop.time() > deadline:
            stop_workers(procs)
            await hub.stop()
            raise RuntimeError("a gateway worker failed to start (see the log above)")
        await asyncio.sleep(0.05)
    return hub, procs, start
