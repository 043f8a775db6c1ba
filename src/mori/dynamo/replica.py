"""One Dynamo worker slot as the gateway's control loop sees a replica.

The control loop (``mori.gateway.control.Controller``) keeps its replicas as engine
adapters: it reads their capacity, probes their health, reads their load and calls the
KV controls they declare. ``DynamoReplica`` is that adapter for one of the router's
worker slots (``mori.dynamo.fleet.WorkerSlots``), read from a ``FleetView`` the router
keeps up to date from Dynamo: healthy while a worker holds the slot and no request to it
failed lately (``failure_hold_s`` after a failure, doubled on each failure in a row, up
to ``MAX_FAILURE_HOLD_S``; an answer resets it); its load is the requests Dynamo's router counts
on that worker. It declares no KV control: a Dynamo router cannot offload, drop or label
one program's KV (docs/dynamo.md), so MORI's decisions act through admission and
placement only. Requests do not go through ``forward``: the router sends them with
Dynamo's own client (``mori.dynamo.turn_handler``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from mori.engines.base import (
    EngineAdapter,
    EngineLoad,
    KVCapacity,
    NotSupportedError,
    RequestHints,
    UpstreamError,
    UpstreamResponse,
)

MAX_FAILURE_HOLD_S = 60.0


class FleetView(Protocol):
    """What the router knows of its workers, by slot."""

    def worker(self, slot: int) -> int | None:
        """The Dynamo instance id serving ``slot`` (None: none now)."""

    def capacity(self, slot: int) -> KVCapacity | None:
        """The slot's worker's KV capacity (None: not known yet)."""

    def active(self, slot: int) -> int | None:
        """Requests Dynamo counts on the slot's worker (None: no reading)."""


class DynamoReplica(EngineAdapter):
    """The replica behind one worker slot."""

    kind: ClassVar[str] = "dynamo"

    def __init__(self, endpoint: str, slot: int, fleet: FleetView,
                 clock: Callable[[], float], failure_hold_s: float = 5.0) -> None:
        super().__init__(f"dynamo://{endpoint}#{slot}")
        self.slot = slot
        self.fleet = fleet
        self.clock = clock
        self.failure_hold_s = failure_hold_s
        self.failed_worker: int | None = None
        self.failed_at = float("-inf")
        self.failures = 0  # in a row, of ``failed_worker``

    def request_failed(self, worker_id: int) -> None:
        """A request to ``worker_id`` failed: the slot counts as down for a while (a
        killed worker stays in discovery until its lease runs out)."""
        self.failures = self.failures + 1 if worker_id == self.failed_worker else 1
        self.failed_worker, self.failed_at = worker_id, self.clock()

    def request_answered(self, worker_id: int) -> None:
        """A request to ``worker_id`` was answered: it works."""
        if worker_id == self.failed_worker:
            self.failed_worker, self.failures = None, 0

    @property
    def failing(self) -> int | None:
        """The slot's worker, if its last request failed (a new worker may take the
        slot)."""
        wid = self.fleet.worker(self.slot)
        return wid if wid is not None and wid == self.failed_worker else None

    def hold_s(self) -> float:
        return min(MAX_FAILURE_HOLD_S, self.failure_hold_s * 2.0 ** max(0, self.failures - 1))

    async def health(self) -> bool:
        wid = self.fleet.worker(self.slot)
        if wid is None:
            return False
        return not (wid == self.failed_worker and self.clock() - self.failed_at < self.hold_s())

    async def capacity(self) -> KVCapacity:
        cap = self.fleet.capacity(self.slot)
        if cap is None:
            raise UpstreamError(f"no worker has published its KV capacity for slot "
                                f"{self.slot} yet", status=503, unhealthy=True)
        return cap

    async def load(self) -> EngineLoad | None:
        n = self.fleet.active(self.slot)
        return None if n is None else EngineLoad(running=n, waiting=0)

    async def models(self) -> list[dict[str, Any]]:
        return []

    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        raise NotSupportedError("the MORI Dynamo router sends requests with Dynamo's "
                                "client, not through the replica adapter")
