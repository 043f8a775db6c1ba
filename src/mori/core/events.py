"""Observations a world reports to a policy, each with the time it happened."""

from __future__ import annotations

from dataclasses import dataclass

from mori.core.idleness import IdlenessHistory
from mori.core.types import Tier


@dataclass(frozen=True, slots=True)
class RequestArrived:
    """A program's request reached the scheduler. ``prompt_tokens`` is its context now.

    A program id the policy has not seen before is a new program.
    """

    program_id: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class KVReady:
    """The forwarded request's KV is loaded (reload or recompute can start prefilling).

    Optional: a world that cannot tell reports nothing and reasoning is taken to start at
    the forward. Reported, the interval between forward and this event is held time.
    """

    program_id: str


@dataclass(frozen=True, slots=True)
class StepFinished:
    """The program's response ended; ``context_tokens`` = prompt + output tokens."""

    program_id: str
    context_tokens: int


@dataclass(frozen=True, slots=True)
class ProgramEnded:
    """The program is finished (or released by its client): its KV becomes inactive."""

    program_id: str


@dataclass(frozen=True, slots=True)
class ReplicaDown:
    """A replica stopped serving (its engine died, hangs, or cannot be reached): every
    program placed on it loses its KV there and goes to the Uncached queue (its next
    request is a recompute elsewhere), and nothing is placed on it until ``ReplicaUp``.
    A program whose step was running there stays Reasoning until the world reports the
    step's end (its request failed) with ``StepFinished``."""

    replica: int


@dataclass(frozen=True, slots=True)
class ReplicaUp:
    """A replica that was down serves again, empty as far as the policy knows."""

    replica: int


@dataclass(frozen=True, slots=True)
class ProgramRestored:
    """A program the policy does not know holds ``context_tokens`` of KV on ``replica``,
    in ``tier`` (GPU or CPU), as the engine reports it (a restarted world reading its
    engines): the program is taken in, Acting (between steps), in that place if it fits
    there, else in the Uncached queue. Ignored for a program the policy already knows.
    ``history``: its idleness history, where one was kept (``--state``); without one
    it starts with none."""

    program_id: str
    context_tokens: int
    replica: int
    tier: Tier
    history: IdlenessHistory | None = None


Event = (RequestArrived | KVReady | StepFinished | ProgramEnded | ReplicaDown | ReplicaUp
         | ProgramRestored)
