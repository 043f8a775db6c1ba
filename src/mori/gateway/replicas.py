"""The engine replicas behind a gateway: health, load counts, ordered KV controls.

Each replica's KV controls (labels, offload, drop, release) run as tasks in the order
they were issued, so a ``Demote`` never overtakes the ``Promote`` before it; a request
is sent only after the controls issued before its forward have run
(``controls_done``). A control that fails is logged; it never stops the gateway.
Every ``health_interval_s`` each replica's engine is probed, each probe with a deadline
(``health_timeout_s``): a healthy replica that misses ``health_failures`` probes in a
row (an engine that hangs: it accepts connections and answers nothing), or whose
connections are refused or die, is marked unhealthy; an unhealthy one that answers is
healthy again. Each change is reported to ``on_change(index, healthy)``: the controller
then moves the replica's programs elsewhere (``ReplicaDown``) and ends its requests in
flight, or takes it back (``ReplicaUp``). Every ``load_interval_s`` each healthy
replica's engine is asked for its load (requests running and waiting, all clients'),
where the adapter can read one; ``foreign_loads()`` is what the policy is told
(``PolicyConfig.spread_by_load``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
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
    missed: int = 0  # health probes missed in a row
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
                 load_interval_s: float = 0.0, health_timeout_s: float = 5.0,
                 health_failures: int = 2,
                 on_change: Callable[[int, bool], None] | None = None) -> None:
        """``load_interval_s``: seconds between readings of the engines' load (0: none).
        ``health_timeout_s``: a probe's deadline; ``health_failures``: probes a healthy
        replica may miss in a row before it is marked unhealthy."""
        self.all = [Replica(i, a) for i, a in enumerate(adapters)]
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.health_failures = health_failures
        self.on_change = on_change
        self.load_interval_s = load_interval_s
        self._probing: set[int] = set()
        self._probes: set[asyncio.Task[None]] = set()
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

    def engine_waiting(self) -> list[int | None]:
        """Each replica's engine's latest waiting count, in order (None: no reading)."""
        return [r.engine_load.waiting if r.engine_load is not None else None
                for r in self.all]

    def engine_running(self) -> list[int | None]:
        """Each replica's engine's latest running count, in order (None: no reading)."""
        return [r.engine_load.running if r.engine_load is not None else None
                for r in self.all]

    def foreign_loads(self) -> list[int]:
        """Each replica's ``Replica.foreign_load``, in order."""
        return [r.foreign_load for r in self.all]

    async def stop(self) -> None:
        pending = dict(self._tasks)
        tasks = [t for t in (self._health, self._loads, *pending, *self._probes)
                 if t is not None]
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
        if not r.healthy:
            return
        log.warning("replica %d (%s) marked unhealthy: %s", index, r.adapter.url, why)
        r.healthy = False
        self._changed(index, False)

    def _mark_healthy(self, r: Replica) -> None:
        r.missed = 0
        if r.healthy:
            return
        log.info("replica %d (%s) is healthy again", r.index, r.adapter.url)
        r.healthy, r.last_error = True, ""  # /healthz: no stale error
        self._changed(r.index, True)

    def _changed(self, index: int, healthy: bool) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(index, healthy)
        except Exception:  # the gateway must outlive a bug in its reaction
            log.exception("reacting to replica %d becoming %s failed", index,
                          "healthy" if healthy else "unhealthy")

    async def probe(self, r: Replica) -> bool:
        """One health probe of ``r``'s engine, within ``health_timeout_s``; marks the
        replica as the answer says (a healthy one only after ``health_failures`` misses
        in a row). Returns whether the engine answered."""
        ok = False
        try:
            async with asyncio.timeout(self.health_timeout_s):
                ok = await r.adapter.health()
        except TimeoutError:
            why = f"no answer to its health check within {self.health_timeout_s:g} s"
        except Exception as e:  # a probe that fails is a missed probe
            why = f"its health check failed: {e}"
        else:
            why = "its health check failed"
        if ok:
            self._mark_healthy(r)
            return True
        r.missed += 1
        if r.healthy and r.missed >= self.health_failures:
            self.mark_unhealthy(r.index, f"{why} ({r.missed} in a row)")
        return False

    def probe_soon(self, index: int) -> None:
        """Probe a replica now (a request to it got no answer in time), not at the next
        round; probes already running are not doubled."""
        if index in self._probing:
            return
        self._probing.add(index)

        async def run() -> None:
            try:
                await self.probe(self.all[index])
            finally:
                self._probing.discard(index)

        task = asyncio.create_task(run())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self.probe(r) for r in self.all
                                   if r.index not in self._probing))

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
        for r in self.all:  # a replica that is down is told when it rejoins (inactive)
            if r.healthy:
                self._control(r.index, r.adapter.release(program_id))

    def _control(self, replica: int, coro: Coroutine[Any, Any, None]) -> None:
        """Run a KV control on a replica, after the ones issued before it."""
        state = self.all[replica]
        prev = state.chain

        async def run() -> None:
            if prev is not None and not prev.done():
                # waits without taking part: a control before it that failed or was
                # cancelled does not cancel this one (awaiting it would)
                await asyncio.wait((prev,))
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
        """Wait until the KV controls issued so far to ``replica`` have run (or failed).

        The chain is waited on, not awaited: a request whose client leaves (its handler
        is cancelled here) must not cancel the replica's controls, which other requests
        wait on too, and a control that was cancelled must not cancel the requests
        waiting for it."""
        tail = self.all[replica].chain
        if tail is not None and not tail.done():
            await asyncio.wait((tail,))
