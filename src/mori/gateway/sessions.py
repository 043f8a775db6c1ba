"""Agent sessions in the gateway: each client session's live programs, each new
program's parent within its session, and the contexts a newer one left behind.

A program's first request names its session where the wire says one
(``RequestFacts.session``, ``mori.gateway.agents``). Its parent (``parent_of``) is the
program the client names, else the session's latest to begin of its programs in a tool
call or still answering: a subagent's parent is the program whose tool call started it.

When a new context of a session begins, the session's other contexts that wait for
nothing (Acting, not in a tool call, nothing in flight or held) and started no live
program were left behind: a compaction's or a ``/clear``'s old conversation, a subagent
that gave its report. Each is released ``abandoned_grace_s`` later unless a request of
its own comes first (``release_due``, on the controller's tick).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mori.core.policy import Policy
from mori.core.types import Status
from mori.gateway.programs import ProgramInfo

log = logging.getLogger("mori.gateway")


class Sessions:
    """The live programs of each session, and the contexts left behind with when each
    is due for release (wall seconds). ``programs``: the controller's program table (read
    here, never changed); ``policy``: whose status says a program waits for nothing."""

    __slots__ = ("members", "_abandoned", "_programs", "_policy", "_wall", "grace_s")

    def __init__(self, programs: dict[str, ProgramInfo], policy: Policy,
                 wall: Callable[[], float], grace_s: float) -> None:
        self.members: dict[str, set[str]] = {}  # a client session's live programs
        self._abandoned: dict[str, float] = {}  # a context left behind -> its release (wall)
        self._programs = programs
        self._policy = policy
        self._wall = wall
        self.grace_s = grace_s

    def join(self, program_id: str, session: str, named: str | None,
             named_session: str | None) -> str | None:
        """``program_id`` begins in ``session``: its parent (``parent_of``; None: none),
        and the session's contexts it leaves behind (``_left_behind``) set for release."""
        members = self.members.setdefault(session, set())
        parent = self.parent_of(members, named, named_session)
        self._left_behind(members, parent)
        members.add(program_id)
        return parent

    def leave(self, program_id: str, session: str | None) -> None:
        """``program_id`` ended: no longer a member of ``session``, nor left behind."""
        self._abandoned.pop(program_id, None)
        if session is not None:
            members = self.members.get(session)
            if members is not None:
                members.discard(program_id)
                if not members:
                    del self.members[session]

    def seen_again(self, program_id: str) -> None:
        """A request of ``program_id`` came: not left behind, it goes on."""
        self._abandoned.pop(program_id, None)

    def parent_of(self, members: set[str], named: str | None,
                  named_session: str | None = None) -> str | None:
        """The parent of a program starting in a session of ``members``: the one the
        client names (``named``: its id, or a prefix of it ending in ':', or in '/' for
        any program of ``named_session``, another session), else the latest to begin
        of the session's programs in a tool call or still answering (Claude Code starts
        a tool as soon as its call has streamed, before the answer ends)."""
        programs = self._programs

        def latest(pids: list[str]) -> str | None:
            times = [(max(p.agent.last_end or 0.0, p.arrived_wall), pid) for pid in pids
                     if (p := programs.get(pid)) is not None]
            return max(times)[1] if times else None

        if named is not None:
            pool = members if named_session is None else self.members.get(named_session, ())
            found = latest([pid for pid in pool if pid == named
                            or (named.endswith((":", "/")) and pid.startswith(named))])
            if found is not None:
                return found
        return latest([pid for pid in members if (p := programs.get(pid)) is not None
                       and (p.agent.in_tool or p.in_flight)])

    def _waits_for_nothing(self, info: ProgramInfo) -> bool:
        """Acting, not in a tool call, no request in flight or held."""
        pol = self._policy.programs.get(info.program_id)
        return (not info.in_flight and info.held is None and not info.agent.in_tool
                and pol is not None and pol.status is Status.ACTING)

    def _left_behind(self, members: set[str], parent: str | None) -> None:
        """A new context of a session of ``members`` begins (its parent: ``parent``):
        the session's programs that wait for nothing and started no live program are
        released ``grace_s`` from now unless seen again (the module doc)."""
        grace = self.grace_s
        if grace <= 0 or not members:
            return
        programs = self._programs
        parents = {parent}
        parents.update(p.agent.parent for pid in members
                       if (p := programs.get(pid)) is not None)
        due = self._wall() + grace
        for pid in members:
            info = programs.get(pid)
            if info is not None and pid not in parents and self._waits_for_nothing(info):
                self._abandoned.setdefault(pid, due)

    def release_due(self, end: Callable[[str], None]) -> None:
        """Release (``end``) the contexts left behind whose grace is over, if they still
        wait for nothing and started no live program since. Each is ended before the
        next is looked at (ending one may end its parent's last live child)."""
        if not self._abandoned:
            return
        now = self._wall()
        programs = self._programs
        for pid in [pid for pid, due in self._abandoned.items() if due <= now]:
            del self._abandoned[pid]
            info = programs.get(pid)
            if info is None or not self._waits_for_nothing(info):
                continue
            session = self.members.get(info.agent.session or "", ())
            if any((p := programs.get(m)) is not None and p.agent.parent == pid
                   for m in session):
                continue
            log.info("program %s: a newer context of its session began; released", pid)
            end(pid)
