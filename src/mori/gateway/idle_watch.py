"""A deadline on each wait for an engine's next bytes, cheap enough for every chunk.

A stream relay waits for its engine's next chunk many times a second. ``IdleWatch`` puts
a deadline on each of those waits without a timer per chunk: ``arm`` notes the deadline
and ``disarm`` the wait's end (a clock read and two fields each); one timer per stream
checks, when it fires, whether the wait in progress has passed its deadline and, if
not, sleeps until it could. A wait that passes its deadline has its task cancelled
where it waits; ``timed_out`` tells that cancellation from any other (the client
leaving, the server stopping), the way ``asyncio.timeout`` does, so the relay turns only
its own into an error.

Only the time spent waiting on the engine counts: a relay held up writing to a slow
client (the engine's connection paused by flow control meanwhile) is not timed here.
"""

from __future__ import annotations

import asyncio

__all__ = ["IdleWatch"]


class IdleWatch:
    """Deadlines on the waits of one stream, on ``loop`` (module doc)."""

    __slots__ = ("_loop", "_deadline", "_waiting", "_task", "_handle", "_handle_at", "_fired",
                 "limit")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._deadline = 0.0
        self._waiting = False
        self._task: asyncio.Task[object] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0  # when the timer fires
        self._fired = False
        self.limit = 0.0
        """The seconds of the wait in progress (set by ``arm``)."""

    def arm(self, seconds: float) -> None:
        """A wait of at most ``seconds`` starts now, in the current task."""
        loop = self._loop
        self.limit = seconds
        self._deadline = loop.time() + seconds
        self._task = asyncio.current_task(loop)
        self._waiting = True
        if self._handle is None or self._handle_at > self._deadline:  # none, or too late
            self._schedule()

    def _schedule(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle_at = self._deadline
        self._handle = self._loop.call_at(self._deadline, self._check)

    def disarm(self) -> None:
        """The wait ended (in time or not)."""
        self._waiting = False

    def _check(self) -> None:
        self._handle = None
        if not self._waiting:
            return  # the next arm starts the timer again
        if self._loop.time() + 1e-3 < self._deadline:
            self._schedule()
            return
        task = self._task
        if task is not None and not task.done():
            self._fired = True
            self._waiting = False
            task.cancel()

    def timed_out(self) -> bool:
        """Whether the ``CancelledError`` being handled is this watch's own (and only):
        then the cancellation is taken back and the wait counts as timed out; False:
        it is someone else's, to be let through."""
        if not self._fired:
            return False
        self._fired = False
        task = self._task
        return task is not None and task.uncancel() == 0

    def stop(self) -> None:
        """No more waits: the timer is let go."""
        self._waiting = False
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
