"""The engine replicas behind a gateway: health, load counts, ordered KV controls.

Each replica's KV controls (labels, offload, drop, release) run as tasks in the order
they were issued, so a ``Demote`` never overtakes the ``Promote`` before it; a request
is sent only after the controls issued before its forward have run
(``controls_done``). A control that fails is logged; it never stops the gateway.
An unhealthy replica (refused or dead connections) is checked again every
``health_interval_s`` until its engine answers. Every ``load_interval_s`` each healthy
replica's engine is asked for its load (requests running and waiting, all clients'),
where the adapter can read one; ``foreign_loads()`` is what the policy is told
(``PolicyConfig.spread_by_load``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from mori.core.types import KVLabel
from mori.engines.base import EngineAdapter, EngineLoad, UpstreamError

log = logging.getLogger("mori.gateway")


@dataclass(slots=True)
class Replica:
    """One engine replica as the gateway tracks it."""

    index: int
    adapter: EngineAdapter
    healthy: bool = True
    in_flight: int = 0
    last_error: str = ""
    errors: int = 0
    chain: asyncio.Future[None] | None = None  # tail of this replica's ordered controls
    engine_load: EngineLoad | None = None  # the engine's latest report (None: none)

    @property
    def foreign_load(self) -> int:
        """Requests the engine reports beyond the gateway's own in flight there: other
        clients' (0 without a reading). Approximate: the reading is up to a
        ``load_interval_s`` old, so a request of the gateway's that ended since still
        counts until the next one."""
        if self.engine_load is None:
            return 0
        return max(0, self.engine_load.requests - self.in_flight)


class Replicas:
    """The replicas of one gateway, indexed as the policy numbers them."""

    def __init__(self, adapters: list[EngineAdapter], health_interval_s: float,
                 load_interval_s: float = 0.0) -> None:
        """``load_interval_s``: seconds between readings of the engines' load (0: none)."""
        self.all = [Replica(i, a) for i, a in enumerate(adapters)]
        self.health_interval_s = health_interval_s
        self.load_interval_s = load_interval_s
        self._tasks: dict[asyncio.Task[None], Coroutine[Any, Any, None]] = {}
        self._health: asyncio.Task[None] | None = None
        self._loads: asyncio.Task[None] | None = None

    def __getitem__(self, index: int) -> Replica:
        return self.all[index]

    def __len__(self) -> int:
        return len(self.all)

    def start(self) -> None:
        self._health = asyncio.create_task(self._health_loop())
        if self.load_interval_s > 0:
            self._loads = asyncio.create_task(self._load_loop())

    def foreign_loads(self) -> list[int]:
        """Each replica's ``Replica.foreign_load``, in order."""
        return [r.foreign_load for r in self.all]

    async def stop(self) -> None:
        pending = dict(self._tasks)
        tasks = [t for t in (self._health, self._loads, *pending) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for coro in pending.values():
            coro.close()  # a control cancelled before it ran: never to be awaited

    # -- health -------------------------------------------------------------------------
    def mark_unhealthy(self, index: int, why: str) -> None:
        r = self.all[index]
        r.errors += 1
        r.last_error = why
        if r.healthy:
            log.warning("replica %d (%s) marked unhealthy: %s", index, r.adapter.url, why)
        r.healthy = False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for r in self.all:
                if r.healthy:
                    continue
                ok = False
                with contextlib.suppress(Exception):
                    ok = await r.adapter.health()
                if ok:
                    log.info("replica %d (%s) is healthy again", r.index, r.adapter.url)
                    r.healthy = True

    async def read_loads(self) -> None:
        """Ask every healthy replica's engine for its load, all at once. A replica that
        does not answer keeps no reading (its load is the gateway's own count)."""
        async def one(r: Replica) -> None:
            try:
                r.engine_load = await r.adapter.load() if r.healthy else None
            except Exception as e:  # a failed reading must not stop the loop
                log.debug("load of replica %d unread: %s", r.index, e)
                r.engine_load = None

        await asyncio.gather(*(one(r) for r in self.all))

    async def _load_loop(self) -> None:
        while True:
            await self.read_loads()
            await asyncio.sleep(self.load_interval_s)

    # -- KV controls, in issue order per replica (the executor's EngineTarget side) ------
    def set_label(self, program_id: str, replica: int, label: KVLabel) -> None:
        self._control(replica, self.all[replica].adapter.set_label(program_id, label))

    def offload(self, program_id: str, replica: int) -> None:
        self._control(replica, self.all[replica].adapter.offload(program_id))

    def drop(self, program_id: str, replica: int) -> None:
        self._control(replica, self.all[replica].adapter.drop(program_id))

    def release(self, program_id: str) -> None:
        for r in self.all:
            self._control(r.index, r.adapter.release(program_id))

    def _control(self, replica: int, coro: Coroutine[Any, Any, None]) -> None:
        """Run a KV control on a replica, after the ones issued before it."""
        state = self.all[replica]
        prev = state.chain

        async def run() -> None:
            if prev is not None and not prev.done():
                with contextlib.suppress(Exception):
                    await prev
            try:
                await coro
            except UpstreamError as e:
                log.warning("KV control on replica %d failed: %s", replica, e.message)
            except Exception:
                log.exception("KV control on replica %d failed", replica)

        task = asyncio.create_task(run())
        state.chain = task
        self._tasks[task] = coro
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    async def controls_done(self, replica: int) -> None:
        """Wait until the KV controls issued so far to ``replica`` have run."""
        tail = self.all[replica].chain
        if tail is not None and not tail.done():
            with contextlib.suppress(Exception):
                await tail
