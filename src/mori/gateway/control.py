"""The control task: the registered policy bound to engine adapters in real time.

The policy is the same object the simulator drives (``mori.core``); only the world
around it changes. The controller reports what happens (a request arrived, a response
ended, a program was released) with a timestamp from its clock, asks the policy for
decisions, and executes them: a ``Forward`` releases a held (gated) request to a
replica; ``Promote`` / ``Demote`` become the KV controls the replica's adapter offers;
``Release`` tells every replica the program's KV is inactive.

Held requests: a request of a program that is not GPU-resident waits in the gateway
until the policy forwards it. The queue is bounded (``max_gated``: beyond it, 429) and
each wait has a timeout (``gate_timeout_s``: beyond it, 503 with ``Retry-After``). A
request that gives up (timeout, client gone) stays held in the policy: if the client
retries before it is forwarded, the retry takes its place; if it is forwarded with no
client waiting, the step ends at once with the context unchanged. So the policy never
sees a request vanish, and no program is left REASONING.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from mori.core.decisions import Decision, Demote, Forward, Promote, Release
from mori.core.events import ProgramEnded, RequestArrived, StepFinished
from mori.core.policy import Policy
from mori.core.types import KVLabel, Status, Tier
from mori.engines.base import Capability, EngineAdapter, UpstreamError
from mori.gateway.metrics import GatewayMetrics

log = logging.getLogger("mori.gateway")


class GateRejected(Exception):
    """A request cannot be admitted now: ``status`` 429 (queue full), 503 (waited too
    long) or 409 (the program already has a request in flight, or was released)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Admission:
    """Where a forwarded request goes. ``reloaded``: the program's KV was on the host
    tier (a prefetch may pull it back first)."""

    replica: int
    reloaded: bool
    waited_s: float


@dataclass(slots=True)
class _Held:
    future: asyncio.Future[Admission]
    arrived_wall: float


@dataclass(slots=True)
class ProgramInfo:
    """Gateway-side facts about a program (the policy holds the rest)."""

    program_id: str
    context_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    anonymous: bool = False
    in_flight: bool = False
    release_pending: bool = False
    last_seen: float = 0.0
    promoted_from: Tier | None = None
    held: _Held | None = None
    orphan_forwards: int = 0


@dataclass(slots=True)
class ReplicaState:
    adapter: EngineAdapter
    healthy: bool = True
    in_flight: int = 0
    last_error: str = ""
    chain: asyncio.Future[None] | None = None  # tail of this replica's ordered controls
    errors: int = 0


@dataclass(frozen=True, slots=True)
class LoggedDecision:
    time: float
    kind: str
    program_id: str
    replica: int | None
    source: str | None = None
    to: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind, "program_id": self.program_id,
                "replica": self.replica, "source": self.source, "to": self.to}


@dataclass(slots=True)
class ControllerSettings:
    time_scale: float = 1.0
    max_gated: int = 1024
    gate_timeout_s: float = 300.0
    retry_after_s: float = 5.0
    program_ttl_s: float = 3600.0
    health_interval_s: float = 2.0
    decision_log: int = 10000


class Controller:
    """Binds one policy to the replicas' adapters. Single-threaded (one event loop)."""

    def __init__(self, policy: Policy, adapters: list[EngineAdapter],
                 metrics: GatewayMetrics, settings: ControllerSettings | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.policy = policy
        self.replicas = [ReplicaState(a) for a in adapters]
        self.metrics = metrics
        self.settings = settings or ControllerSettings()
        loop_clock = clock or asyncio.get_running_loop().time
        self._wall = loop_clock
        self._t0 = loop_clock()
        self.programs: dict[str, ProgramInfo] = {}
        self.log: collections.deque[LoggedDecision] = collections.deque(
            maxlen=self.settings.decision_log)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._health: asyncio.Task[None] | None = None
        self.decisions_executed = 0

    # -- clock --------------------------------------------------------------------------
    def now(self) -> float:
        """Policy time: seconds since start, times ``time_scale``."""
        return (self._wall() - self._t0) * self.settings.time_scale

    def wall(self) -> float:
        return self._wall()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        tick = self.policy.tick_interval
        if tick:
            self._ticker = asyncio.create_task(self._tick_loop(tick / self.settings.time_scale))
        self._health = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        for t in (self._ticker, self._health, *self._tasks):
            if t is not None:
                t.cancel()
        for t in (self._ticker, self._health, *self._tasks):
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        for p in self.programs.values():
            if p.held is not None and not p.held.future.done():
                p.held.future.set_exception(GateRejected(503, "the gateway is shutting down"))

    async def _tick_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                self._expire_programs()
                self.decide()
            except Exception:  # a bug must not stop the control loop silently
                log.exception("policy tick failed")
                raise

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            for i, r in enumerate(self.replicas):
                if r.healthy:
                    continue
                ok = False
                with contextlib.suppress(Exception):
                    ok = await r.adapter.health()
                if ok:
                    log.info("replica %d (%s) is healthy again", i, r.adapter.url)
                    r.healthy = True

    # -- the request path ---------------------------------------------------------------
    def program(self, program_id: str) -> ProgramInfo:
        p = self.programs.get(program_id)
        if p is None:
            p = ProgramInfo(program_id)
            self.programs[program_id] = p
        return p

    async def admit(self, program_id: str, prompt_tokens: int, anonymous: bool = False
                    ) -> Admission:
        """Report the request and wait until the policy forwards it."""
        info = self.programs.get(program_id)
        if info is not None and info.in_flight:
            raise GateRejected(409, f"program {program_id!r} already has a request in flight; "
                               "an agent program sends one request at a time")
        if info is not None and info.release_pending:
            raise GateRejected(409, f"program {program_id!r} was released")
        info = self.program(program_id)
        info.anonymous = anonymous
        info.last_seen = self.wall()
        pol = self.policy.programs.get(program_id)
        if pol is not None and pol.status is Status.GATED and info.held is not None:
            # a retry of a request still held by the policy: take its place
            old = info.held
            if not old.future.done():
                old.future.set_exception(GateRejected(409, "superseded by a retry"))
            held = _Held(asyncio.get_running_loop().create_future(), old.arrived_wall)
            info.held = held
        else:
            if self.gated_count() >= self.settings.max_gated:
                raise GateRejected(429, f"{self.gated_count()} requests are already waiting "
                                   "for GPU residency; retry later",
                                   self.settings.retry_after_s)
            held = _Held(asyncio.get_running_loop().create_future(), self.wall())
            info.held = held
            info.prompt_tokens = prompt_tokens
            self.policy.observe(RequestArrived(program_id, prompt_tokens), self.now())
            self.decide()
        if not held.future.done():
            self.metrics.gated_total.inc()
        try:
            adm = await asyncio.wait_for(asyncio.shield(held.future),
                                         self.settings.gate_timeout_s)
        except TimeoutError:
            held.future.cancel()  # abandoned: still held in the policy, for a retry
            raise GateRejected(
                503, f"program {program_id!r} waited {self.settings.gate_timeout_s:g} s "
                "for GPU residency; retry later", self.settings.retry_after_s) from None
        except BaseException:
            held.future.cancel()  # the client went away while its request was held
            raise
        info.in_flight = True
        return adm

    def gated_count(self) -> int:
        return len(self.policy.ready_programs)

    def finished(self, program_id: str, context_tokens: int) -> None:
        """The forwarded request ended (normally, by error, or the client left)."""
        info = self.programs.get(program_id)
        if info is None or not info.in_flight:
            return
        info.in_flight = False
        info.last_seen = self.wall()
        info.context_tokens = max(context_tokens, info.prompt_tokens)
        info.steps += 1
        self.policy.observe(StepFinished(program_id, info.context_tokens), self.now())
        if info.anonymous or info.release_pending:
            self._end(program_id)
        self.decide()

    def release(self, program_id: str) -> bool:
        """The client says the program ended. False if the gateway does not know it."""
        info = self.programs.get(program_id)
        if info is None:
            return False
        if info.in_flight:
            info.release_pending = True  # ends when its response does
            return True
        if info.held is not None and not info.held.future.done():
            info.held.future.set_exception(GateRejected(409, f"program {program_id!r} was "
                                                        "released while its request waited"))
        self._end(program_id)
        self.decide()
        return True

    def _end(self, program_id: str) -> None:
        if program_id in self.policy.programs:
            self.policy.observe(ProgramEnded(program_id), self.now())
        self.programs.pop(program_id, None)

    def _expire_programs(self) -> None:
        ttl = self.settings.program_ttl_s
        if ttl <= 0:
            return
        cutoff = self.wall() - ttl
        for pid, info in list(self.programs.items()):
            pol = self.policy.programs.get(pid)
            if (not info.in_flight and info.last_seen < cutoff and pol is not None
                    and pol.status is Status.ACTING):
                log.info("program %s idle for over %g s: released", pid, ttl)
                self._end(pid)

    # -- deciding and executing -------------------------------------------------------------
    def decide(self) -> None:
        now = self.now()
        decisions = self.policy.decide(now)
        orphans: list[str] = []
        for d in decisions:
            self._execute(d, now, orphans)
        for pid in orphans:  # after this round's decisions, so rounds do not interleave
            info = self.programs.get(pid)
            if info is not None:
                self.finished(pid, info.context_tokens or info.prompt_tokens)

    def _execute(self, d: Decision, now: float, orphans: list[str]) -> None:
        self.decisions_executed += 1
        typed = self.policy.engine.typed_eviction
        if isinstance(d, Forward):
            self.log.append(LoggedDecision(now, "forward", d.program_id, d.replica))
            self._on_forward(d, orphans)
        elif isinstance(d, Promote):
            self.log.append(LoggedDecision(now, "promote", d.program_id, d.replica,
                                           d.source.value))
            self.metrics.promotions.labels(source=d.source.value).inc()
            info = self.programs.get(d.program_id)
            if info is not None:
                info.promoted_from = d.source
            adapter = self.replicas[d.replica].adapter
            if typed and adapter.supports(Capability.LABELS):
                self._control(d.replica, adapter.set_label(d.program_id, KVLabel.BUSY))
        elif isinstance(d, Demote):
            self.log.append(LoggedDecision(now, "demote", d.program_id,
                                           d.replica if d.replica >= 0 else None,
                                           d.source.value, d.to.value))
            self.metrics.demotions.labels(to=d.to.value).inc()
            if d.replica < 0:
                return
            adapter = self.replicas[d.replica].adapter
            if typed and adapter.supports(Capability.LABELS):
                label = KVLabel.IDLE if d.to is Tier.CPU else KVLabel.INACTIVE
                self._control(d.replica, adapter.set_label(d.program_id, label))
            elif d.source is Tier.GPU:
                if adapter.supports(Capability.OFFLOAD):
                    self._control(d.replica, adapter.offload(d.program_id))
                elif d.to is Tier.NONE and adapter.supports(Capability.DROP):
                    self._control(d.replica, adapter.drop(d.program_id))
        elif isinstance(d, Release):
            self.log.append(LoggedDecision(now, "release", d.program_id, d.replica))
            for i, r in enumerate(self.replicas):
                self._control(i, r.adapter.release(d.program_id))

    def _on_forward(self, d: Forward, orphans: list[str]) -> None:
        info = self.programs.get(d.program_id)
        held = info.held if info is not None else None
        if info is None or held is None or held.future.done():
            # nobody waits any more (timed out or gone): the step ends at once, unchanged
            if info is not None:
                info.held = None
                info.in_flight = True
                info.orphan_forwards += 1
                orphans.append(d.program_id)
            return
        info.held = None
        waited = self.wall() - held.arrived_wall
        self.metrics.gate_wait.observe(waited)
        reloaded = info.promoted_from is Tier.CPU
        info.promoted_from = None
        held.future.set_result(Admission(d.replica, reloaded, waited))

    def _control(self, replica: int, coro: Coroutine[Any, Any, None]) -> None:
        """Run a KV control on a replica, after the ones issued before it."""
        state = self.replicas[replica]
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
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def controls_done(self, replica: int) -> None:
        """Wait until the KV controls issued so far to ``replica`` have run."""
        tail = self.replicas[replica].chain
        if tail is not None and not tail.done():
            with contextlib.suppress(Exception):
                await tail

    # -- replica health -------------------------------------------------------------------
    def mark_unhealthy(self, replica: int, why: str) -> None:
        r = self.replicas[replica]
        r.errors += 1
        r.last_error = why
        if r.healthy:
            log.warning("replica %d (%s) marked unhealthy: %s", replica, r.adapter.url, why)
        r.healthy = False

    # -- inspection -------------------------------------------------------------------------
    def describe(self, program_id: str) -> dict[str, Any] | None:
        pol = self.policy.programs.get(program_id)
        info = self.programs.get(program_id)
        if pol is None:
            return None
        now = self.now()
        last = pol.history[-1] if pol.history else None
        return {
            "program_id": program_id,
            "status": pol.status.value,
            "tier": pol.tier.value,
            "replica": pol.replica,
            "idleness": round(pol.iota(now), 6),
            "context_tokens": pol.tokens,
            "kv_bytes": pol.kv_bytes,
            "gated_s": round(pol.tracker.gated_time, 6),
            "steps": pol.steps_done,
            # the three timestamps of the latest step (policy seconds): arrival at the
            # gateway, forward to the engine (the gated interval between), response end
            "last_step": ({"arrived": last.arrived, "forwarded": last.forwarded,
                           "finished": last.finished} if last is not None else None),
            "in_flight": bool(info and info.in_flight),
            "anonymous": bool(info and info.anonymous),
        }

    def describe_all(self) -> list[dict[str, Any]]:
        out = []
        for pid in sorted(self.policy.programs):
            d = self.describe(pid)
            if d is not None:
                out.append(d)
        return out

