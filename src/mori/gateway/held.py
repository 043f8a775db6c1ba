"""Held requests: a request waiting in the gateway for the policy to forward it, and how
it is answered (an ``Admission``, or an ``AdmissionRejected``).

A request of a program that is not GPU-resident is held in the gateway until the policy
forwards it. At most ``max_held`` are held at once (beyond: 429) and each for at most
``hold_timeout_s`` (beyond: 503 with ``Retry-After``). A request that gives up (timeout,
client gone) stays held in the policy: if the client retries before it is forwarded, the
retry takes its place; if it is forwarded with no client waiting, the step ends at once
with the context unchanged. So the policy never sees a request vanish, and no program is
left Reasoning.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class AdmissionRejected(Exception):
    """A request cannot be admitted now: ``status`` 429 (too many held, or the key's
    program quota), 503 (held too long, or its replica is down) or 409 (the program
    already has a request in flight, or was released)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a forwarded request goes. ``reloaded``: the program's KV was on the host
    tier (a prefetch may pull it back first). ``waited_s``: wall seconds held."""

    replica: int
    reloaded: bool
    waited_s: float


@dataclass(slots=True)
class HeldRequest:
    """A client waiting for its request to be forwarded."""

    future: asyncio.Future[Admission]
    arrived_wall: float

    @property
    def waiting(self) -> bool:
        return not self.future.done()

    def reject(self, status: int, message: str) -> None:
        if not self.future.done():
            self.future.set_exception(AdmissionRejected(status, message))
