"""A program as the policy sees it."""

from __future__ import annotations

from dataclasses import dataclass, field

from mori.core.idleness import IdlenessTracker
from mori.core.types import Status, Tier


@dataclass(slots=True)
class StepRecord:
    """The three timestamps of one step plus its arrival (MORI.md section 3)."""

    arrived: float
    forwarded: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class Program:
    """Scheduler state of one program.

    ``tokens`` is the context the ledger accounts for: the prompt of its latest request,
    then prompt + output once the step finished. ``ready`` means a request is held
    (status GATED). ``returning`` means it has completed at least one step.
    """

    program_id: str
    tracker: IdlenessTracker
    status: Status = Status.GATED
    tokens: int = 0
    kv_bytes: int = 0
    tier: Tier = Tier.NONE
    replica: int | None = None
    ready: bool = False
    ready_seq: int = 0
    returning: bool = False
    lazy_demote: bool = False
    steps_done: int = 0
    history: list[StepRecord] = field(default_factory=list)

    HISTORY_LIMIT = 16  # steps of timestamps kept for inspection

    def iota(self, now: float) -> float:
        return self.tracker.iota(now)

    def record(self, rec: StepRecord) -> None:
        self.history.append(rec)
        if len(self.history) > self.HISTORY_LIMIT:
            del self.history[0]
