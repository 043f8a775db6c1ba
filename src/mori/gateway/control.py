"""The control loop: the registered policy bound to engine replicas in real time.

The policy is the same object the simulator drives (``mori.core``); only the world
around it changes. The controller reports what happens (a request arrived, its KV is
ready, a response ended, a program was released) with a timestamp from its clock, asks
the policy for decisions and hands them to the shared ``DecisionExecutor``
(``mori.core.execution``), whose engine actions land here: ``submit`` releases a held
request (see ``mori.gateway.held``), the KV controls go to the replicas in order
(``mori.gateway.replicas``). It decides on every event and on every tick of policy time
(wall x ``time_scale``); a tick also releases programs idle past ``program_ttl_s``.

It holds the gateway's program table (``mori.gateway.programs``) and admits requests;
the rest is in parts it holds as fields: the per-key quotas (``quotas``,
``mori.gateway.quotas``), the sessions with each program's parent and the contexts left
behind (``sessions``, ``mori.gateway.sessions``), the trace recording (``recording``,
``mori.gateway.recording``) and the engines' prices (``prices``,
``mori.gateway.engine_prices``).

Programs that linger are let go sooner where the wire says they are done. A side request
(``RequestFacts.side``: a tool-less one-shot, ``mori.protocol.apis.is_side_request``) is
a one-step program, released at its step's end. When a new context of a session begins,
the contexts it left behind are released ``abandoned_grace_s`` later unless a request of
their own comes first (``mori.gateway.sessions``).

A replica marked unhealthy (``mori.gateway.replicas``: refused, dead, or missing its
health probes) is reported to the policy as ``ReplicaDown``: its programs go to Uncached
and are placed again on the healthy replicas, where their next step recomputes; its
requests in flight end at once (503, or an error event in a stream), in this process and
in the workers (``replica_listeners``). When it answers again it rejoins
(``ReplicaUp``), and the programs that were moved off it are labelled inactive there.
At start, ``restore`` reads what the engines still hold (``mori.gateway.restore``) and
gives each program found its place back (``ProgramRestored``): a restarted gateway routes
each program to the replica that holds its KV.

A request goes through ``lease()``: admission, then a ``RequestLease`` that covers the
forward until ``finish`` (``mori.gateway.lease``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from mori.core.decision_log import DecisionLog
from mori.core.events import (
    KVReady,
    ProgramEnded,
    ProgramRestored,
    ReplicaDown,
    ReplicaUp,
    RequestArrived,
    StepFinished,
)
from mori.core.execution import DecisionExecutor
from mori.core.explain import context_reader
from mori.core.idleness import IdlenessHistory
from mori.core.policy import Policy
from mori.core.returns import ReturnPredictor
from mori.core.types import Capability, KVLabel, Status, Tier
from mori.engines.base import EngineAdapter, UpstreamError
from mori.gateway.agents import RequestFacts, StepFacts
from mori.gateway.config import GatewaySettings
from mori.gateway.engine_prices import EnginePrices, Stretch
from mori.gateway.held import Admission, AdmissionRejected, HeldRequest
from mori.gateway.lease import RequestLease
from mori.gateway.metrics import GatewayMetrics
from mori.gateway.programs import ProgramInfo, SeenOrder
from mori.gateway.quotas import KeyQuotas
from mori.gateway.recording import Recording
from mori.gateway.replicas import Replica, Replicas
from mori.gateway.restore import read_residency
from mori.gateway.sessions import Sessions

log = logging.getLogger("mori.gateway")


class Controller:
    """Binds one policy to the replicas' adapters. Single-threaded (one event loop).

    ``clock``: wall seconds (default: the running loop's monotonic clock); tests pass a
    fake one.
    """

    def __init__(self, policy: Policy, adapters: list[EngineAdapter], metrics: GatewayMetrics,
                 settings: GatewaySettings, clock: Callable[[], float] | None = None) -> None:
        self.policy = policy
        self.settings = settings
        self.metrics = metrics
        self.replicas = Replicas(adapters, settings.health_interval_s,
                                 settings.load_interval_s, settings.health_timeout_s,
                                 settings.health_failures, on_change=self._replica_changed)
        for a in adapters:
            a.first_byte_timeout_s = settings.first_byte_timeout_s
            a.max_response_bytes = settings.max_response_bytes
        self.replica_listeners: list[Callable[[int, bool, str], None]] = []
        """Called with (replica, healthy, why) on each change (the workers' hub)."""
        self._moved_off: dict[int, set[str]] = {}  # a down replica: the programs moved
        self.quotas = KeyQuotas(bool(settings.api_keys or settings.admin_keys),
                                settings.max_programs_per_key)
        self._wall = clock or asyncio.get_running_loop().time
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once known
        self._t0 = self._wall()
        self.programs: dict[str, ProgramInfo] = {}
        self.seen = SeenOrder()  # the programs, the longest unseen first (the idle timeout)
        self.log = DecisionLog(settings.decision_log, context_reader(
            policy.programs, policy.return_cost))
        self.executor = DecisionExecutor(policy.engine_profile,
                                         lambda r: self.replicas[r].adapter.capabilities,
                                         _Target(self), self.log)
        self._orphans: list[str] = []
        self._ticker: asyncio.Task[None] | None = None
        self.sessions = Sessions(self.programs, policy, self._wall, settings.abandoned_grace_s)
        self.recording = Recording(self._wall)  # its recorder set by the gateway (--record)
        self.returns = ReturnPredictor()  # a tool call's predicted length (mori.core.returns)
        self.prices = EnginePrices(policy, len(adapters), settings.time_scale,
                                   settings.learn_costs)

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
        self.replicas.start()

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._ticker
        await self.replicas.stop()
        for p in self.programs.values():
            if p.held is not None:
                p.held.reject(503, "the gateway is shutting down")
        self.recording.close()

    async def _tick_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                self.tick()
            except Exception:  # a bug must not stop the control loop silently
                log.exception("policy tick failed")
                raise

    def tick(self) -> None:
        """One tick of the control loop: expire idle programs, decide."""
        self._expire_programs()
        self.sessions.release_due(self._end)
        self.decide()

    # -- the request path ---------------------------------------------------------------
    async def lease(self, program_id: str, prompt_tokens: int, anonymous: bool = False,
                    facts: RequestFacts | None = None) -> RequestLease:
        """Admit the request (waiting while it is held) and lease its replica.

        Raises ``AdmissionRejected``: 409, 429, 503 (held too long, or its replica is down).
        """
        adm = await self.admit(program_id, prompt_tokens, anonymous, facts)
        lease = RequestLease(self, program_id, adm, prompt_tokens)
        r = lease.replica
        if not r.healthy:
            lease.finish(prompt_tokens)
            raise AdmissionRejected(503, f"the program's replica ({r.index}) is unhealthy; retry "
                                    "later", self.settings.retry_after_s)
        return lease

    async def admit(self, program_id: str, prompt_tokens: int, anonymous: bool = False,
                    facts: RequestFacts | None = None) -> Admission:
        """Report the request and wait until the policy forwards it. ``facts``: what the
        request says of its agent (``mori.gateway.agents``)."""
        s = self.settings
        info = self.programs.get(program_id)
        if info is not None and info.in_flight:
            raise AdmissionRejected(409, "this program already has a request in flight; "
                                    "an agent program sends one request at a time")
        if info is not None and info.release_pending:
            raise AdmissionRejected(409, "this program was released")
        if not any(r.healthy for r in self.replicas.all):
            raise AdmissionRejected(503, "every engine replica is unhealthy; retry later",
                                    s.retry_after_s)
        if info is None:
            self.quotas.check(program_id, s.retry_after_s)
            info = self.programs[program_id] = self._new_program(program_id, facts)
        info.anonymous = anonymous or info.agent.side
        self.sessions.seen_again(program_id)  # not left behind: it goes on
        self.seen.seen(info, self.wall())
        if facts is not None and not (info.held is not None and info.held.waiting):
            info.arrived_wall = info.last_seen
            info.text = facts.text
            track = info.agent
            tools, expected = track.pending_tools, track.expected_tool_s
            took = track.arrived(facts, info.last_seen)
            if took is not None:
                self.metrics.tool_time.labels(track.agent).observe(took)
                self.returns.observe(took, tools, track.agent)
                if expected is not None:
                    self.metrics.tool_time_error.labels(track.agent).observe(
                        abs(expected - took))
        pol = self.policy.programs.get(program_id)
        loop = self._loop
        if loop is None:  # kept: get_running_loop makes a system call (mori.engines.http1_client)
            loop = self._loop = asyncio.get_running_loop()
        if pol is not None and pol.status is Status.HELD and info.held is not None:
            # a retry of a request still held by the policy: take its place
            old = info.held
            old.reject(409, "superseded by a retry")
            held = info.held = HeldRequest(loop.create_future(), old.arrived_wall)
        else:
            if self.policy.held_count >= s.max_held:
                raise AdmissionRejected(429, f"{self.policy.held_count} requests are already "
                                        "waiting for GPU residency; retry later", s.retry_after_s)
            held = info.held = HeldRequest(loop.create_future(), self.wall())
            info.prompt_tokens = prompt_tokens
            self.policy.observe(RequestArrived(program_id, prompt_tokens), self.now())
            self.decide()
        fut = held.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            info.in_flight = True  # forwarded at once: nothing to wait for
            return fut.result()
        if held.waiting:
            self.metrics.held_total.inc()
        try:
            adm = await asyncio.wait_for(asyncio.shield(fut), s.hold_timeout_s)
        except TimeoutError:
            held.future.cancel()  # abandoned: still held in the policy, for a retry
            raise AdmissionRejected(503, f"the request waited {s.hold_timeout_s:g} s "
                                    "for GPU residency; retry later", s.retry_after_s) from None
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # forwarded just as the client went away: end the step at once, unchanged
                info.in_flight = True
                info.orphan_forwards += 1
                self.finished(program_id, info.context_tokens or info.prompt_tokens)
            fut.cancel()  # the client went away while its request was held
            raise
        info.in_flight = True
        return adm

    # -- what a lease asks of it (mori.gateway.lease.LeaseHost) ---------------------------
    def replica(self, index: int) -> Replica:
        return self.replicas[index]

    def idleness_of(self, program_id: str) -> float | None:
        p = self.policy.programs.get(program_id)
        return None if p is None else p.idleness(self.now())

    async def controls_done(self, replica: int) -> None:
        await self.replicas.controls_done(replica)

    def upstream_failed(self, replica: int, e: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(str(replica)).inc()
        if e.unhealthy:
            self.replicas.mark_unhealthy(replica, e.message)
        elif e.status == 504 and self.replicas[replica].healthy:  # no answer in time: hung?
            self.replicas.probe_soon(replica)

    def kv_ready(self, program_id: str) -> None:
        """The forwarded request's KV is in place: reasoning starts now (the interval
        since the forward was the reload, held time, as in the simulator)."""
        info = self.programs.get(program_id)
        if info is not None and info.in_flight:
            self.policy.observe(KVReady(program_id), self.now())

    def _new_program(self, program_id: str, facts: RequestFacts | None) -> ProgramInfo:
        """A program's first request: its agent, its session and, within the session,
        its parent (``Sessions.join``)."""
        info = ProgramInfo(program_id)
        self.quotas.add(program_id)
        if facts is None:
            return info
        track = info.agent
        track.recogniser, track.agent, track.session = (facts.recogniser, facts.agent,
                                                        facts.session)
        track.side = facts.side
        if facts.side:  # a one-step program: no member of its session, not recorded
            return info
        if facts.session is not None:
            track.parent = self.sessions.join(program_id, facts.session, facts.parent,
                                              facts.parent_session)
        self.recording.start(program_id, track)
        return info

    def finished(self, program_id: str, context_tokens: int,
                 step: StepFacts | None = None) -> None:
        """The forwarded request ended (normally, by error, or the client left);
        ``step``: what its answer said (usage, tool calls), where it was read."""
        info = self.programs.get(program_id)
        if info is None or not info.in_flight:
            return
        info.in_flight = False
        self.seen.seen(info, self.wall())
        info.context_tokens = max(context_tokens, info.prompt_tokens)
        info.steps += 1
        track = info.agent
        track.ended(step, info.last_seen)
        if track.in_tool:
            track.expected_tool_s = self.returns.expect_s(track.recent, track.pending_tools,
                                                          track.agent)
        if not info.anonymous and step is not None:
            self.recording.step(info, step)
        self.policy.observe(StepFinished(program_id, info.context_tokens), self.now())
        if info.anonymous or info.release_pending:
            self._end(program_id)
        self.decide()

    def answered(self, replica: int, sent: float) -> Stretch:
        """A request sent to ``replica`` at ``sent`` got its first byte now
        (``EnginePrices.answered``)."""
        return self.prices.answered(replica, sent, self.wall())

    def priced(self, replica: int, stretch: Stretch, reloaded: bool,
               step: StepFacts | None) -> None:
        """A request of ``stretch`` ended (``EnginePrices.ended``)."""
        self.prices.ended(replica, stretch, reloaded, step)

    def release(self, program_id: str) -> bool:
        """The client says the program ended. False if the gateway does not know it."""
        info = self.programs.get(program_id)
        if info is None:
            return False
        if info.in_flight:
            info.release_pending = True  # ends when its response does
            return True
        if info.held is not None:
            info.held.reject(409, "the program was released while its request "
                             "waited")
        self._end(program_id)
        self.decide()
        return True

    def _end(self, program_id: str) -> None:
        if program_id in self.policy.programs:
            self.policy.observe(ProgramEnded(program_id), self.now())
        info = self.programs.pop(program_id, None)
        self.seen.forget(program_id)
        self.sessions.leave(program_id, info.agent.session if info is not None else None)
        if info is not None:
            self.quotas.discard(program_id)
            if not info.anonymous:
                self.recording.end(program_id)

    def _expire_programs(self) -> None:
        """Release the programs unseen for ``program_ttl_s`` that wait for nothing
        (Acting, no request in flight). Only those unseen that long are looked at
        (``SeenOrder``), not every program held: a tick stays cheap however many
        programs sit idle (a program held or in flight past the cutoff is seen again
        when its step ends)."""
        ttl = self.settings.program_ttl_s
        if ttl <= 0:
            return
        cutoff = self.wall() - ttl
        for info in self.seen.unseen_since(cutoff):
            pid = info.program_id
            pol = self.policy.programs.get(pid)
            if (not info.in_flight and info.last_seen < cutoff and pol is not None
                    and pol.status is Status.ACTING):
                log.info("program %s idle for over %g s: released", pid, ttl)
                self._end(pid)

    # -- replicas that fail and come back, and a restart --------------------------------
    def _replica_changed(self, index: int, healthy: bool) -> None:
        """``Replicas.on_change``: tell the policy, end the requests in flight there (down)
        or label inactive there what was moved off it (up), decide."""
        r = self.replicas[index]
        why = r.last_error or "its engine stopped answering"
        if not healthy:
            pl = self.policy.placement
            moved = {*pl.gpu[index].members, *pl.cpu[index].members}
            self._moved_off.setdefault(index, set()).update(moved)
            self.policy.observe(ReplicaDown(index), self.now())
            aborted = r.adapter.abort_requests(f"replica {index} was marked unhealthy")
            self.metrics.failovers.inc(len(moved))
            log.warning("replica %d down: %d program(s) moved to the other replicas (their "
                        "KV recomputed there), %d request(s) in flight ended", index,
                        len(moved), aborted)
        else:
            self.policy.observe(ReplicaUp(index), self.now())
            stale = self._moved_off.pop(index, set())
            if r.adapter.supports(Capability.LABELS):
                pl = self.policy.placement
                for pid in stale:  # KV it may still hold of programs now elsewhere
                    if (pl.where(pid)[1] if pid in pl else None) != index:
                        self.replicas.set_label(pid, index, KVLabel.INACTIVE)
            log.info("replica %d rejoined", index)
        for listener in self.replica_listeners:
            try:
                listener(index, healthy, why)
            except Exception:
                log.exception("a replica listener failed")
        self.decide()

    async def restore(self, histories: Mapping[str, IdlenessHistory] | None = None) -> int:
        """Give back their places to the programs whose KV the engines still hold (a
        restarted gateway; ``mori.gateway.restore``). ``histories``: idleness histories
        kept across the restart (``--state``); a restored program found there keeps its
        rank. Returns how many programs were restored."""
        histories = histories or {}
        found = await read_residency(self.replicas)
        now, wall = self.now(), self.wall()
        for pid, at in found.items():  # the best placed first
            self.policy.observe(ProgramRestored(pid, at.tokens, at.replica, at.tier,
                                                histories.get(pid)), now)
            info = self.programs.get(pid) or self._new_program(pid, None)
            self.programs[pid] = info
            self.seen.seen(info, wall)
            info.context_tokens = at.tokens
        if found:
            placed = sum(1 for pid in found if self.policy.programs[pid].tier is not Tier.NONE)
            kept = sum(1 for pid in found if pid in histories)
            log.info("restored %d program(s) from the engines' residency: %d back in "
                     "their place, %d waiting; %d with their idleness history", len(found),
                     placed, len(found) - placed, kept)
            self.decide()
        return len(found)

    # -- deciding -------------------------------------------------------------------------
    def decide(self) -> None:
        now = self.now()
        if self.policy.config.spread_by_load:
            self.policy.set_foreign_loads(self.replicas.foreign_loads())
        self.policy.set_engine_queues(self.replicas.engine_waiting(), now,
                                      self.replicas.engine_running())
        self.executor.execute(now, self.policy.decide(now))
        orphans, self._orphans = self._orphans, []
        for pid in orphans:  # after this round's decisions, so rounds do not interleave
            info = self.programs.get(pid)
            if info is not None:
                self.finished(pid, info.context_tokens or info.prompt_tokens)

    def _submit(self, program_id: str, replica: int, reload: bool) -> None:
        info = self.programs.get(program_id)
        held = info.held if info is not None else None
        if info is None or held is None or not held.waiting:
            # nobody waits any more (timed out or gone): the step ends at once, unchanged
            if info is not None:
                info.held = None
                info.in_flight = True
                info.orphan_forwards += 1
                self._orphans.append(program_id)
            return
        info.held = None
        waited = self.wall() - held.arrived_wall
        self.metrics.held_seconds.observe(waited)
        held.future.set_result(Admission(replica, reload, waited))

    # -- inspection -------------------------------------------------------------------------
    def describe(self, program_id: str) -> dict[str, Any] | None:
        v = self.policy.view(program_id, self.now())
        if v is None:
            return None
        info = self.programs.get(program_id)
        last = v.last_step
        return {
            "program_id": program_id, "status": v.status.value, "tier": v.tier.value,
            "replica": v.replica, "idleness": round(v.idleness, 6),
            "context_tokens": v.context_tokens, "kv_bytes": v.kv_bytes,
            "held_s": round(v.held_s, 6), "steps": v.steps,
            # the three timestamps of the latest step (policy seconds): arrival at the
            # gateway, forward to the engine (the held interval between), response end
            "last_step": ({"arrived": last.arrived, "forwarded": last.forwarded,
                           "finished": last.finished} if last is not None else None),
            "in_flight": bool(info and info.in_flight),
            "held_because": self.policy.hold_reason(program_id, self.now()),
            "anonymous": bool(info and info.anonymous),
            **(info.agent.as_dict() if info is not None else {}),
        }

    def describe_page(self, owner: str | None, after: str | None, limit: int
                      ) -> tuple[list[dict[str, Any]], bool]:
        """One page of program descriptions, by id: those of the key namespace ``owner``
        (None: every program), with ids after ``after``, at most ``limit``; and whether
        more follow. A key's page costs what its own programs do, not every program's."""
        ids = self.policy.programs.keys() if owner is None else self.quotas.programs_of(owner)
        chosen = sorted(pid for pid in ids if after is None or pid > after)
        rows = [d for pid in chosen[:limit] if (d := self.describe(pid)) is not None]
        return rows, len(chosen) > limit

    def describe_all(self) -> list[dict[str, Any]]:
        return [d for pid in sorted(self.policy.programs)
                if (d := self.describe(pid)) is not None]


class _Target:
    """The executor's engine actions in the gateway: a forward releases the held
    request; KV controls run on the replicas in issue order."""

    __slots__ = ("_ctl",)

    def __init__(self, ctl: Controller) -> None:
        self._ctl = ctl

    def submit(self, program_id: str, replica: int, reload: bool) -> None:
        self._ctl._submit(program_id, replica, reload)

    def set_label(self, program_id: str, replica: int, label: KVLabel) -> None:
        self._ctl.replicas.set_label(program_id, replica, label)

    def offload(self, program_id: str, replica: int) -> None:
        self._ctl.replicas.offload(program_id, replica)

    def drop(self, program_id: str, replica: int) -> None:
        self._ctl.replicas.drop(program_id, replica)

    def release(self, program_id: str) -> None:
        self._ctl.replicas.release(program_id)
