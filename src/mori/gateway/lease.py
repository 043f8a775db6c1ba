"""A request lease: one forwarded request, from admission to its end.

``Controller.lease()`` admits the request and returns a ``RequestLease`` for the replica
the policy chose. The lease counts the request in flight on that replica, waits for the
KV controls issued before the forward (and, for a program promoted from the CPU tier,
an engine's prefetch) and then reports the KV ready (``prepare``), or, for an engine
that says when in its stream, reports it on that signal (``kv_ready``), so the reload
counts as held time as in the simulator; it marks the replica
unhealthy on an engine failure that says so (``failed``), and reports the end of the
step exactly once (``finish``), however the request ends. Its first byte (``answering``)
and its usage price the engine (``mori.gateway.engine_prices``).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from mori.core.types import Capability
from mori.engines.base import EngineAdapter, UpstreamError
from mori.gateway.agents import StepFacts
from mori.gateway.engine_prices import Stretch
from mori.gateway.held import Admission
from mori.gateway.replicas import Replica

log = logging.getLogger("mori.gateway")


class LeaseHost(Protocol):
    """What a lease asks of the controller that granted it, and nothing more."""

    def replica(self, index: int) -> Replica: ...

    def idleness_of(self, program_id: str) -> float | None:
        """The program's idleness now (None: the policy does not know it)."""

    async def controls_done(self, replica: int) -> None:
        """Until the KV controls issued to ``replica`` so far have been carried out."""

    def kv_ready(self, program_id: str) -> None: ...

    def upstream_failed(self, replica: int, e: UpstreamError) -> None:
        """Count the failure; mark the replica unhealthy if it says so, else probe it
        soon after a timeout."""

    def finished(self, program_id: str, context_tokens: int,
                 step: StepFacts | None = None) -> None: ...

    def wall(self) -> float: ...

    def answered(self, replica: int, sent: float) -> Stretch:
        """A request sent to ``replica`` at ``sent`` got its first byte now: the stretch
        of engine time it ends (``mori.gateway.engine_prices``)."""

    def priced(self, replica: int, stretch: Stretch, reloaded: bool,
               step: StepFacts | None) -> None:
        """A request of ``stretch`` ended (``step``: its usage; None: it failed)."""

PRIORITY_LEVELS = 10
"""Priority hints run from 0 (busiest) to this (most idle): idleness in tenths."""


async def warm_up(adapter: EngineAdapter, program_id: str, reloaded: bool, path: str,
                  body: dict[str, Any], stream: bool) -> bool:
    """After a promotion from the CPU tier, let an engine that can prefetch pull the KV
    back. True when the KV is ready now; False when the engine will say so in its stream
    (``Capability.KV_READY``)."""
    if reloaded and adapter.supports(Capability.PREFETCH):
        try:
            await adapter.prefetch(program_id, path, dict(body))
        except Exception as e:  # a failed warm-up only costs the reload it tried to hide
            log.info("prefetch for %s failed: %s", program_id, e)
    return not (stream and adapter.supports(Capability.KV_READY))


class RequestLease:
    """The controller's hold on one forwarded request; ``finish`` ends it."""

    def __init__(self, ctl: LeaseHost, program_id: str, admission: Admission,
                 prompt_tokens: int) -> None:
        self._ctl = ctl
        self.program_id = program_id
        self.admission = admission
        self.prompt_tokens = prompt_tokens
        self.replica: Replica = ctl.replica(admission.replica)
        self.replica.in_flight += 1
        self.sent = ctl.wall()  # when the engine got it: ``sending`` moves it on
        self._stretch: Stretch | None = None  # the engine time its first byte ended
        self._done = False
        self._kv_ready = False

    @property
    def adapter(self) -> EngineAdapter:
        return self.replica.adapter

    @property
    def priority(self) -> int:
        """MORI's rank of the program now: 0 = busiest (see ``RequestHints``)."""
        idleness = self._ctl.idleness_of(self.program_id)
        return 0 if idleness is None else min(PRIORITY_LEVELS,
                                              int(idleness * PRIORITY_LEVELS))

    async def prepare(self, path: str, body: dict[str, Any], stream: bool) -> None:
        """Wait for the replica's earlier KV controls and, after a promotion from the
        CPU tier, let an engine that can prefetch pull the KV back. Then the KV is
        ready and reasoning starts, unless the engine will say when (a stream from an
        engine with ``KV_READY``: the relay calls ``kv_ready`` on its signal)."""
        await self._ctl.controls_done(self.replica.index)
        self.sending()
        if await warm_up(self.adapter, self.program_id, self.admission.reloaded, path, body,
                         stream):
            self.kv_ready()

    def kv_ready(self) -> None:
        """The request's KV is in place (the end of a reload): once, while it runs."""
        if not self._done and not self._kv_ready:
            self._kv_ready = True
            self._ctl.kv_ready(self.program_id)

    def sending(self) -> None:
        """The request goes to the engine now (its KV controls done)."""
        self.sent = self._ctl.wall()

    def answering(self) -> None:
        """The engine's first byte came (its prefill is over): once."""
        if self._stretch is None and not self._done:
            self._stretch = self._ctl.answered(self.replica.index, self.sent)

    def failed(self, e: UpstreamError) -> None:
        """The engine failed this request; a failure that says so marks it unhealthy."""
        self._ctl.upstream_failed(self.replica.index, e)
        if not e.unhealthy:  # the client hears only what happened; the details go here
            log.warning("program %s on replica %d: %s", self.program_id,
                        self.replica.index, e.message)

    def finish(self, context_tokens: int, step: StepFacts | None = None) -> None:
        """The request ended (normally, by error, or the client left): once. ``step``:
        what its answer said (``mori.gateway.agents``)."""
        if self._done:
            return
        self._done = True
        self.replica.in_flight -= 1
        if self._stretch is not None:
            self._ctl.priced(self.replica.index, self._stretch, self.admission.reloaded, step)
        self._ctl.finished(self.program_id, context_tokens, step)
