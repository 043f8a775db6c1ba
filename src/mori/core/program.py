"""A program as the policy sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from mori.core.idleness import IdlenessTracker
from mori.core.types import Status, Tier


@dataclass(slots=True)
class StepRecord:
    """The three timestamps of one step plus its arrival (docs/system.md, "Idleness")."""

    arrived: float
    forwarded: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class Program:
    """Scheduler state of one program.

    ``tokens`` is the context the ledger accounts for: the prompt of its latest request,
    then prompt + output once the step finished. ``status`` is read from the idleness
    tracker, the program's one phase machine: HELD means a request is held.
    ``ready_seq`` orders held requests by arrival, and ``ready_at`` is the time of the
    latest. ``returning`` means it has completed
    at least one step.
    """

    program_id: str
    tracker: IdlenessTracker
    tokens: int = 0
    kv_bytes: int = 0
    tier: Tier = Tier.NONE
    replica: int | None = None
    ready_seq: int = 0
    ready_at: float = 0.0  # when the held request (or the latest one) arrived
    returning: bool = False
    steps_done: int = 0
    history: list[StepRecord] = field(default_factory=list)

    HISTORY_LIMIT = 16  # steps of timestamps kept for inspection

    @property
    def status(self) -> Status:
        # a program exists from its first request on, so the tracker has a phase; a
        # tracker that has seen nothing yet reads as held (its first request is)
        return self.tracker.status or Status.HELD

    @property
    def ready(self) -> bool:
        """A request is held (not yet forwarded)."""
        return self.tracker.status is Status.HELD

    def idleness(self, now: float) -> float:
        return self.tracker.idleness(now)

    def record(self, rec: StepRecord) -> None:
        self.history.append(rec)
        if len(self.history) > self.HISTORY_LIMIT:
            del self.history[0]


@dataclass(frozen=True, slots=True)
class ProgramView:
    """A read-only snapshot of one program for inspection (``Policy.view``)."""

    program_id: str
    status: Status
    tier: Tier
    replica: int | None
    idleness: float
    context_tokens: int
    kv_bytes: int
    held_s: float
    steps: int
    last_step: StepRecord | None  # a copy: the latest step's three timestamps

    @classmethod
    def of(cls, p: Program, now: float) -> ProgramView:
        last = p.history[-1] if p.history else None
        return cls(p.program_id, p.status, p.tier, p.replica, p.idleness(now), p.tokens,
                   p.kv_bytes, p.tracker.held_time, p.steps_done,
                   StepRecord(last.arrived, last.forwarded, last.finished) if last else None)
