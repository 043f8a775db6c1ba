"""Held requests: the gateway side of a program, and how a held request is answered.

A request of a program that is not GPU-resident waits in the gateway until the policy
forwards it. The queue is bounded (``max_gated``: beyond it, 429) and each wait has a
timeout (``gate_timeout_s``: beyond it, 503 with ``Retry-After``). A request that gives
up (timeout, client gone) stays held in the policy: if the client retries before it is
forwarded, the retry takes its place; if it is forwarded with no client waiting, the
step ends at once with the context unchanged. So the policy never sees a request
vanish, and no program is left Reasoning.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from mori.gateway.agents import AgentTrack


class GateRejected(Exception):
    """A request cannot be admitted now: ``status`` 429 (queue full), 503 (waited too
    long, or its replica is down) or 409 (the program already has a request in flight,
    or was released)."""

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
            self.future.set_exception(GateRejected(status, message))


@dataclass(slots=True)
class ProgramInfo:
    """Gateway-side facts about a program (the policy holds the rest).

    ``in_flight``: a request was forwarded and has not ended. ``release_pending``: the
    client released it while a request ran; it ends with that request.
    ``orphan_forwards``: forwards that found no client waiting.
    """

    program_id: str
    context_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    anonymous: bool = False
    in_flight: bool = False
    release_pending: bool = False
    last_seen: float = 0.0
    held: HeldRequest | None = None
    orphan_forwards: int = 0
    arrived_wall: float = 0.0  # when its latest request arrived
    text: str | None = None  # its latest prompt's last turn (recorded with --record-text)
    agent: AgentTrack = field(default_factory=AgentTrack)


class SeenOrder:
    """The programs by the wall time they were last seen (``ProgramInfo.last_seen``),
    the longest unseen first. A program seen again moves to the end in O(1), so the
    idle timeout finds the programs unseen since a cutoff from the front, looking at
    those and at one more (``unseen_since``), not at every program held.

    The order holds as long as ``seen`` is called with a wall clock that never goes
    back (the loop's monotonic clock).
    """

    __slots__ = ("_order", "looked_at")

    def __init__(self) -> None:
        self._order: OrderedDict[str, ProgramInfo] = OrderedDict()
        self.looked_at = 0
        """Programs ``unseen_since`` has looked at, in all (what a test counts)."""

    def __len__(self) -> int:
        return len(self._order)

    def seen(self, info: ProgramInfo, wall: float) -> None:
        """``info``'s program was seen at ``wall``: its ``last_seen``, and its place."""
        info.last_seen = wall
        order = self._order
        order[info.program_id] = info
        order.move_to_end(info.program_id)

    def forget(self, program_id: str) -> None:
        self._order.pop(program_id, None)

    def unseen_since(self, cutoff: float) -> list[ProgramInfo]:
        """The programs last seen before ``cutoff``, the longest unseen first."""
        out = []
        for info in self._order.values():
            self.looked_at += 1
            if info.last_seen >= cutoff:
                break
            out.append(info)
        return out
