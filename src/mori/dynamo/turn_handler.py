"""A turn through MORI's control loop: admitted, pinned, forwarded, ended.

``TurnHandler.handle`` is the body of the router's ``generate`` endpoint, without Dynamo:
the router (``mori.dynamo.router``) hands it Dynamo's forward (``KvRouter.
generate_from_request``) and its KV view, and tests hand it fakes.

For each request: ``read_turn`` names the program (``agent_context.session_id``; none: a
one-off, scheduled as a one-step program). ``session_final`` releases the program and is
not forwarded. Otherwise the control loop admits the turn (``Controller.lease``), holding
it while MORI keeps the program off the GPU; the time between the program's turns is its
tool time, so its idleness is what MORI ranks. The turn goes to the worker of the slot
MORI placed the program on (``routing.backend_instance_id``); a turn MORI held goes that
many seconds up the engine's queue (``routing.priority_jump``), so a program let back in
does not wait a second time behind the engine's newer arrivals. The answer's usage
(prompt, completion and cached tokens) ends the step. A request whose worker fails marks
its slot down (``DynamoReplica.request_failed``): MORI places the slot's programs on the
other workers, where their next turn recomputes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mori.dynamo.fleet import TierOverlap, WorkerSlots
from mori.dynamo.replica import DynamoReplica
from mori.dynamo.turns import (
    ONE_OFF_PREFIX,
    ChunkFacts,
    TurnError,
    forwarded,
    read_turn,
    wants_engine_data,
    with_engine_data,
)
from mori.engines.base import UpstreamError
from mori.gateway.agents import RequestFacts, StepFacts
from mori.gateway.control import Controller
from mori.gateway.held import AdmissionRejected

log = logging.getLogger("mori.dynamo")

Forward = Callable[[dict[str, Any]], Awaitable[AsyncIterator[Any]]]
"""Sends a preprocessed request on; its answer's chunks (``KvRouter.generate_from_request``)."""
OverlapReader = Callable[[list[int]], Awaitable[dict[int, TierOverlap]]]
"""A prompt's cached tokens per worker and tier (``KvRouter.get_overlap_scores``)."""

HELD_AT_LEAST_S = 0.01
"""A turn admitted after this long was held by MORI (one admitted at once waits only for
the round that forwards it): it gets a ``priority_jump`` of its wait."""

ENGINE_DATA_KEY = "mori"
"""The key of the router's report in an answer's ``engine_data``."""


class RouterError(Exception):
    """A turn the router refuses: ``status`` as HTTP (400 bad input, 409 a conflict, 429
    too many held, 503 no worker or held too long) and what to do about it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class TurnCounts:
    """What the router did, for its status endpoint and logs."""

    turns: int = 0
    one_offs: int = 0
    released: int = 0
    held: int = 0
    refused: int = 0
    failed: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(slots=True)
class TurnHandler:
    """The router's requests through one ``Controller`` over ``slots``' workers."""

    controller: Controller
    slots: WorkerSlots
    replicas: list[DynamoReplica]
    forward: Forward
    overlaps: OverlapReader | None = None
    max_id_bytes: int = 256
    max_prompt_tokens: int | None = None
    """The most tokens a turn may bring (a worker's GPU KV); None: no check."""
    counts: TurnCounts = field(default_factory=TurnCounts)
    _anonymous: Iterator[int] = field(default_factory=itertools.count)

    async def handle(self, request: Mapping[str, Any]) -> AsyncIterator[Any]:
        """The answer's chunks. Raises ``RouterError``."""
        try:
            turn = read_turn(request, self.max_id_bytes)
        except TurnError as e:
            self.counts.refused += 1
            raise RouterError(400, str(e)) from None
        ctl = self.controller
        if turn.final:
            assert turn.program_id is not None
            known = ctl.release(turn.program_id)
            self.counts.released += known
            log.info("program %s: session_final, %s", turn.program_id,
                     "released" if known else "not known (already released?)")
            return
        if self.max_prompt_tokens is not None and turn.prompt_tokens > self.max_prompt_tokens:
            self.counts.refused += 1
            raise RouterError(400, f"the prompt has {turn.prompt_tokens} tokens and a "
                              f"worker's GPU KV cache holds {self.max_prompt_tokens}: "
                              "shorten the context (compact it), or serve workers with a "
                              "larger KV cache")
        anonymous = turn.program_id is None
        pid = turn.program_id or f"{ONE_OFF_PREFIX}{next(self._anonymous)}"
        facts = None if anonymous else RequestFacts(
            recogniser="dynamo-session", agent="dynamo", session=pid, parent=turn.parent,
            parent_session=turn.parent)
        try:
            lease = await ctl.lease(pid, turn.prompt_tokens, anonymous, facts)
        except AdmissionRejected as e:
            self.counts.refused += 1
            raise RouterError(e.status, e.message) from None
        slot = lease.replica.index
        worker = self.slots.worker(slot)
        if worker is None:  # the slot's worker left between the admission and now
            lease.failed(UpstreamError(f"replica {slot} has no worker", 503))
            lease.finish(turn.prompt_tokens)
            raise RouterError(503, f"the worker MORI placed program {pid} on left; retry "
                              "and it is placed on another")
        waited = lease.admission.waited_s
        if waited < HELD_AT_LEAST_S:
            waited = 0.0
        self.counts.turns += 1
        self.counts.one_offs += anonymous
        self.counts.held += waited > 0
        tiers = await self._tiers(request, worker)
        await lease.prepare("", {}, True)
        out = forwarded(request, worker, waited)
        report = wants_engine_data(request)
        seen = ChunkFacts()
        step: StepFacts | None = None
        try:
            try:
                chunks = await self.forward(out)
                first = True
                async for chunk in chunks:
                    if first:
                        first = False
                        lease.answering()
                        self.replicas[slot].request_answered(worker)
                    seen.read(chunk)
                    if report and seen.finish_reason is not None:
                        chunk = with_engine_data(chunk, ENGINE_DATA_KEY, self._report(
                            pid, slot, worker, waited, lease.admission.reloaded, seen, tiers))
                    yield chunk
            except Exception as e:
                self.counts.failed += 1
                self.replicas[slot].request_failed(worker)
                lease.failed(UpstreamError(f"worker {worker}: {e}", 503, unhealthy=True))
                raise RouterError(503, f"worker {worker} (replica {slot}) failed: {e}; "
                                  "retry and MORI places the program on another") from e
            step = StepFacts(prompt_tokens=seen.prompt_tokens, cached_tokens=seen.cached_tokens,
                             output_tokens=seen.completion_tokens)
            self.counts.prompt_tokens += seen.prompt_tokens or turn.prompt_tokens
            self.counts.cached_tokens += seen.cached_tokens or 0
        finally:
            lease.finish(seen.context_tokens(turn.prompt_tokens), step)

    async def _tiers(self, request: Mapping[str, Any], worker: int) -> TierOverlap | None:
        """The chosen worker's cached prefix of this prompt by tier (None: not read)."""
        if self.overlaps is None or not wants_engine_data(request):
            return None
        try:
            return (await self.overlaps(list(request["token_ids"]))).get(worker)
        except Exception as e:  # a report, never a reason to fail the turn
            log.debug("overlap scores unread: %s", e)
            return None

    def _report(self, pid: str, slot: int, worker: int, waited: float, reloaded: bool,
                seen: ChunkFacts, tiers: TierOverlap | None) -> dict[str, Any]:
        ctl = self.controller
        info = ctl.programs.get(pid)
        return {
            "program_id": pid, "replica": slot, "worker_id": worker,
            "held_s": round(waited, 6), "reloaded": reloaded,
            "steps": (info.steps + 1) if info is not None else 1,
            "programs": len(ctl.policy.programs),
            "cached_tokens": seen.cached_tokens,
            "tiers": None if tiers is None else {
                "device": tiers.device_tokens, "host": tiers.host_tokens,
                "disk": tiers.disk_tokens},
        }

    def status(self) -> dict[str, Any]:
        """The router's state: slots, counts, programs."""
        ctl = self.controller
        return {
            "workers": [{"replica": i, "worker_id": w, "healthy": ctl.replicas[i].healthy}
                        for i, w in enumerate(self.slots.workers)],
            "counts": {k: getattr(self.counts, k) for k in TurnCounts.__dataclass_fields__},
            "programs": ctl.describe_all(),
        }
