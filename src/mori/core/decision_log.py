"""The decision log: the most recent executed decisions, each with the policy time it
was taken at and, where the log reads it, the decided program's state then, so that a
record can say why (``mori.core.explain``). The gateway's ``/v1/decisions``, the
dashboard and the parity test read it; ``mori.core.execution.DecisionExecutor`` appends
to it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from mori.core.decisions import Decision, Demote, Promote, Release
from mori.core.explain import ContextReader, DecisionContext
from mori.core.explain import reason as reason_for


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One executed decision, the policy time it was taken at and, where the log reads
    it, the program's state then (``mori.core.explain``; not part of equality)."""

    time: float
    decision: Decision
    context: DecisionContext | None = field(default=None, compare=False)

    @property
    def kind(self) -> str:
        return type(self.decision).__name__.lower()

    def as_dict(self) -> dict[str, Any]:
        d = self.decision
        source = d.source.value if isinstance(d, (Promote, Demote)) else None
        out: dict[str, Any] = {"time": self.time, "kind": self.kind,
                               "program_id": d.program_id, "replica": d.replica,
                               "source": source, "to": d.to.value if isinstance(d, Demote) else None}
        if self.context is not None or isinstance(d, Release):
            out["reason"] = self.reason
        return out

    @property
    def reason(self) -> str:
        return reason_for(self.decision, self.context)


class DecisionLog:
    """The most recent ``limit`` executed decisions, oldest first (None: all of them).

    ``context``: reads the decided program's state as each decision is logged (see
    ``mori.core.explain.context_reader``), so records can say why; None reads nothing.
    """

    def __init__(self, limit: int | None = None, context: ContextReader | None = None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"a decision log keeps >= 0 records, got {limit}")
        self._records: deque[DecisionRecord] = deque(maxlen=limit)
        self._context = context

    def append(self, time: float, decision: Decision) -> None:
        if self._records.maxlen != 0:
            ctx = self._context(decision, time) if self._context is not None else None
            self._records.append(DecisionRecord(time, decision, ctx))

    def read_context(self, reader: ContextReader | None) -> None:
        """Read the decided program's state with ``reader`` from now on (a world that
        builds its policy after the log passes it in here)."""
        self._context = reader

    def latest(self, n: int) -> list[DecisionRecord]:
        """The ``n`` most recent records, newest first."""
        out: list[DecisionRecord] = []
        for r in reversed(self._records):
            if len(out) >= n:
                break
            out.append(r)
        return out

    def since(self, time: float) -> list[DecisionRecord]:
        return [r for r in self._records if r.time >= time]

    def __iter__(self) -> Iterator[DecisionRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)
