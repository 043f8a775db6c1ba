"""How busy each replica's engine has been lately, as the policy sees it: ``ReplicaLoad``.

A replica is *busy* while at least one of its programs has a step on the engine (between
the policy's forward and the step's end). Its busy share is that indicator averaged over
the recent past with an exponential decay of time constant ``window_s`` (policy
seconds): a replica busy for the last ``window_s`` reads about 0.63 if it was idle
before, 1.0 after many windows of being busy. A replica nobody has used yet reads 1.0,
the cautious guess (MORI's drop price assumes a busy engine until it learns otherwise).

Where the engine is read, its own running count gives a second busy share
(``engine_busy_share``): the engine's, not the policy's view of it.

A replica is *queued* while its engine reports requests waiting for admission (its own
batching full, or loads of KV in progress): ``queued``, told by whoever reads the
engines (the gateway, from each engine's running and waiting counts). Its queue share is
that indicator averaged the same way; a replica whose engine was never read reads 0 (no
queue known), so a world that reads no engine (the simulator) sees the busy share alone.

Pure bookkeeping: time is passed in; the policy calls ``started`` on each forward,
``finished`` on each step's end (or a program's end while its step runs) and ``lost``
when a replica goes down.
"""

from __future__ import annotations

import math


class DecayedShare:
    """The recent share of time an on/off indicator was on: an exponential average with
    time constant ``window_s``, starting at ``initial``."""

    __slots__ = ("window_s", "_share", "_at", "on")

    def __init__(self, window_s: float, initial: float) -> None:
        self.window_s = window_s
        self._share = initial
        self._at: float | None = None
        self.on = False

    def at(self, now: float) -> float:
        """The share at ``now``, in [0, 1]."""
        at = self._at
        if at is None or now <= at:
            return min(1.0, max(0.0, self._share))
        keep = math.exp(-(now - at) / self.window_s)
        return min(1.0, max(0.0, self._share * keep + (1.0 - keep) * (1.0 if self.on else 0.0)))

    def set(self, on: bool, now: float) -> None:
        """The indicator is ``on`` from ``now``."""
        self._share = self.at(now)
        self._at = now if self._at is None else max(self._at, now)
        self.on = on


class ReplicaLoad:
    """Per replica, the recent share of time its engine had a step to run, and the
    recent share of time it had requests waiting (see the module docstring)."""

    def __init__(self, replicas: int, window_s: float) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s}")
        self.window_s = window_s
        self._busy = [DecayedShare(window_s, 1.0) for _ in range(replicas)]
        self._queue = [DecayedShare(window_s, 0.0) for _ in range(replicas)]
        # the engine's own running count, where it is read (None: never read)
        self._engine_busy: list[DecayedShare | None] = [None] * replicas
        self._running = [0] * replicas
        self._where: dict[str, int] = {}  # program -> the replica its step runs on

    def _settle(self, replica: int, now: float) -> None:
        self._busy[replica].set(self._running[replica] > 0, now)

    def started(self, program_id: str, replica: int, now: float) -> None:
        """``program_id``'s step was forwarded to ``replica``."""
        self.finished(program_id, now)  # at most one step per program
        self._running[replica] += 1
        self._settle(replica, now)
        self._where[program_id] = replica

    def finished(self, program_id: str, now: float) -> None:
        """``program_id``'s step ended (or the program did): no-op if none was running."""
        r = self._where.pop(program_id, None)
        if r is None:
            return
        self._running[r] -= 1
        self._settle(r, now)

    def lost(self, replica: int, now: float) -> None:
        """``replica`` went down: its running steps are gone."""
        self._running[replica] = 0
        self._settle(replica, now)
        self._queue[replica].set(False, now)
        for pid in [p for p, r in self._where.items() if r == replica]:
            del self._where[pid]

    def running(self, replica: int) -> int:
        """Steps running on ``replica`` now, as the policy forwarded them."""
        return self._running[replica]

    def share(self, replica: int, now: float) -> float:
        """``replica``'s busy share at ``now``, in [0, 1]."""
        return self._busy[replica].at(now)

    def queued(self, replica: int, waiting: bool, now: float) -> None:
        """``replica``'s engine reports requests waiting (``waiting``) from ``now``."""
        self._queue[replica].set(waiting, now)

    def engine_running(self, replica: int, running: bool, now: float) -> None:
        """``replica``'s engine reports requests running (``running``) from ``now``."""
        share = self._engine_busy[replica]
        if share is None:
            share = self._engine_busy[replica] = DecayedShare(self.window_s, 1.0)
        share.set(running, now)

    def engine_read(self, replica: int) -> bool:
        """Whether ``replica``'s engine's running count was ever read."""
        return self._engine_busy[replica] is not None

    def engine_busy_share(self, replica: int, now: float) -> float:
        """The recent share of time ``replica``'s engine reported requests running,
        where it is read; else the busy share as the policy forwarded steps (``share``,
        which in a gateway also counts a request's time outside the engine: its way
        through the gateway, the engine's front end and the answer's streaming)."""
        share = self._engine_busy[replica]
        return self.share(replica, now) if share is None else share.at(now)

    def queued_now(self, replica: int) -> bool:
        """Whether ``replica``'s engine reported requests waiting at its last reading."""
        return self._queue[replica].on

    def queue_share(self, replica: int, now: float) -> float:
        """``replica``'s queue share at ``now``, in [0, 1] (0: never told of a queue)."""
        return self._queue[replica].at(now)
