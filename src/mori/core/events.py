"""Observations a world reports to a policy, each with the time it happened."""

from __future__ import annotations

from dataclasses import dataclass


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
    the forward. Reported, the interval between forward and this event is gated time.
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


Event = RequestArrived | KVReady | StepFinished | ProgramEnded
