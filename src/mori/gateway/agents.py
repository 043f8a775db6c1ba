"""What the gateway learns of a program's agent from the wire: who it is, its tool calls,
and how long they took.

A request says which recogniser named its program, the agent kind and the session
(``RequestFacts``, from ``mori.gateway.identity``), and whether it returns tool results
(``mori.protocol.apis.carries_tool_results``). Its answer says what the step used and
which tools it called (``StepFacts``, from ``mori.gateway.answers``). ``AgentTrack``
keeps them per program: an answer that ends in a tool call leaves the program Acting in
that tool until its next request, and when that request carries the tool results, the
time between is the tool's time (``tool_s``). When a tool call starts, the gateway
predicts its length (``expected_tool_s``, ``mori.core.returns``: from the tools called,
else the agent kind's recent calls) and, when it ends, keeps the error
(``last_tool_error_s``, predicted minus actual). Both kinds of facts travel between the
gateway's processes as plain dicts (``as_msg`` / ``from_msg``).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

MAX_TOOL_NAMES = 64
"""The most distinct tool names kept per program (an agent with more: the first ones)."""
MAX_TOOL_NAME_CHARS = 64
RECENT_TOOL_CALLS = 5
"""A program's own tool times kept for predicting its next one (the idleness window)."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a request says of its program: the ``recogniser`` that named it, the
    ``agent`` kind, the client's ``session`` (None: none), ``tool_results`` (it returns
    the results of the previous answer's tool calls), ``text`` (the prompt's last turn,
    only when the gateway records text), ``parent`` (the program that started this one,
    or the prefix of its id, where the client names it), ``parent_session`` (the session
    that prefix is in, where it is another one: an opencode subagent's), ``side`` (a
    side request, ``mori.protocol.apis.is_side_request``: a one-step program)."""

    recogniser: str = "program-id"
    agent: str = "client"
    session: str | None = None
    tool_results: bool = False
    text: str | None = None
    parent: str | None = None  # the parent's program id (or its prefix), where named
    parent_session: str | None = None
    side: bool = False

    def as_msg(self) -> dict[str, Any]:
        return {"rec": self.recogniser, "agent": self.agent, "session": self.session,
                "tr": self.tool_results, "text": self.text, "parent": self.parent,
                "ps": self.parent_session, "side": self.side}

    @staticmethod
    def from_msg(m: dict[str, Any] | None) -> RequestFacts:
        if not m:
            return RequestFacts()
        s = m.get("session")
        t, p, ps = m.get("text"), m.get("parent"), m.get("ps")
        return RequestFacts(str(m.get("rec", "program-id")), str(m.get("agent", "client")),
                            None if s is None else str(s), bool(m.get("tr", False)),
                            None if t is None else str(t), None if p is None else str(p),
                            None if ps is None else str(ps), bool(m.get("side", False)))


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What an answer said of its step: tokens the engine reported (None: it did not),
    and the tools it called, in order."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    tool_names: tuple[str, ...] = ()

    def as_msg(self) -> dict[str, Any]:
        return {"p": self.prompt_tokens, "c": self.cached_tokens, "o": self.output_tokens,
                "tools": list(self.tool_names)}

    @staticmethod
    def from_msg(m: dict[str, Any] | None) -> StepFacts | None:
        if not m:
            return None

        def num(v: Any) -> int | None:
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        tools = m.get("tools") or ()
        return StepFacts(num(m.get("p")), num(m.get("c")), num(m.get("o")),
                         tuple(str(t)[:MAX_TOOL_NAME_CHARS] for t in tools))


@dataclass(slots=True)
class AgentTrack:
    """One program's agent, as seen on the wire (wall-clock seconds throughout)."""

    recogniser: str = "program-id"
    agent: str = "client"
    session: str | None = None
    parent: str | None = None  # the program that was in a tool call when this one began
    side: bool = False  # a side request: released at its step's end
    tools: Counter[str] = field(default_factory=Counter)
    pending_tools: tuple[str, ...] = ()  # the last answer's tool calls, not yet answered
    last_end: float | None = None
    tool_steps: int = 0
    tool_s: float = 0.0
    last_tool_s: float | None = None
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_TOOL_CALLS))
    expected_tool_s: float | None = None  # the pending call's predicted length
    last_tool_error_s: float | None = None  # the last call's, predicted minus actual

    def arrived(self, facts: RequestFacts, wall: float) -> float | None:
        """A request came: the tool time it ends, if it returns the tool results of the
        previous answer's calls (None otherwise)."""
        took = None
        if self.pending_tools and facts.tool_results and self.last_end is not None:
            took = max(0.0, wall - self.last_end)
            self.tool_steps += 1
            self.tool_s += took
            self.last_tool_s = took
            self.recent.append(took)
            if self.expected_tool_s is not None:
                self.last_tool_error_s = self.expected_tool_s - took
        self.pending_tools = ()
        self.expected_tool_s = None
        return took

    def ended(self, facts: StepFacts | None, wall: float) -> None:
        """The step's answer ended: its tool calls are pending until the next request."""
        self.last_end = wall
        names = facts.tool_names if facts is not None else ()
        self.pending_tools = names
        for n in names:
            if n in self.tools or len(self.tools) < MAX_TOOL_NAMES:
                self.tools[n] += 1

    @property
    def in_tool(self) -> bool:
        return bool(self.pending_tools)

    def as_dict(self) -> dict[str, Any]:
        return {"recogniser": self.recogniser, "agent": self.agent, "session": self.session,
                "parent": self.parent, "side": self.side,
                "tools": dict(self.tools.most_common()),
                "in_tool": list(self.pending_tools), "tool_steps": self.tool_steps,
                "tool_s": round(self.tool_s, 6),
                "last_tool_s": _round(self.last_tool_s),
                "expected_tool_s": _round(self.expected_tool_s),
                "last_tool_error_s": _round(self.last_tool_error_s)}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
