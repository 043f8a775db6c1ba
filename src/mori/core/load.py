"""How busy each replica's engine has been lately, as the policy sees it: ``ReplicaLoad``.

A replica is *busy* while at least one of its programs has a step on the engine (between
the policy's forward and the step's end). Its busy share is that indicator averaged over
the recent past with an exponential decay of time constant ``window_s`` (policy
seconds): a replica busy for the last ``window_s`` reads about 0.63 if it was idle
before, 1.0 after many windows of being busy. A replica nobody has used yet reads 1.0,
the cautious guess (MORI's drop price assumes a busy engine until it learns otherwise).

Pure bookkeeping: time is passed in; the policy calls ``started`` on each forward,
``finished`` on each step's end (or a program's end while its step runs) and ``lost``
when a replica goes down.
"""

from __future__ import annotations

import math


class ReplicaLoad:
    """Per replica, the recent share of time its engine had a step to run (see the
    module docstring)."""

    def __init__(self, replicas: int, window_s: float) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s}")
        self.window_s = window_s
        self._share = [1.0] * replicas
        self._at: list[float | None] = [None] * replicas
        self._running = [0] * replicas
        self._where: dict[str, int] = {}  # program -> the replica its step runs on

    def _decayed(self, replica: int, now: float) -> float:
        at = self._at[replica]
        share = self._share[replica]
        if at is None or now <= at:
            return share
        keep = math.exp(-(now - at) / self.window_s)
        return share * keep + (1.0 - keep) * (1.0 if self._running[replica] else 0.0)

    def _advance(self, replica: int, now: float) -> None:
        self._share[replica] = self._decayed(replica, now)
        at = self._at[replica]
        self._at[replica] = now if at is None else max(at, now)

    def started(self, program_id: str, replica: int, now: float) -> None:
        """``program_id``'s step was forwarded to ``replica``."""
        self.finished(program_id, now)  # at most one step per program
        self._advance(replica, now)
        self._running[replica] += 1
        self._where[program_id] = replica

    def finished(self, program_id: str, now: float) -> None:
        """``program_id``'s step ended (or the program did): no-op if none was running."""
        r = self._where.pop(program_id, None)
        if r is None:
            return
        self._advance(r, now)
        self._running[r] -= 1

    def lost(self, replica: int, now: float) -> None:
        """``replica`` went down: its running steps are gone."""
        self._advance(replica, now)
        self._running[replica] = 0
        for pid in [p for p, r in self._where.items() if r == replica]:
            del self._where[pid]

    def running(self, replica: int) -> int:
        """Steps running on ``replica`` now, as the policy forwarded them."""
        return self._running[replica]

    def share(self, replica: int, now: float) -> float:
        """``replica``'s busy share at ``now``, in [0, 1]."""
        return min(1.0, max(0.0, self._decayed(replica, now)))
