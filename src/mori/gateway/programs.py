"""The gateway's program table: what the gateway knows of each program
(``ProgramInfo``; the policy holds the rest), and the programs in the order they were
last seen (``SeenOrder``, what the idle timeout reads).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from mori.gateway.agents import AgentTrack
from mori.gateway.held import HeldRequest


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
