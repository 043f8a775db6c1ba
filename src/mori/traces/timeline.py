"""From timestamped LLM calls to steps: the rules shared by the transcript importers.

An importer (Claude Code, Codex) reduces a session to a list of :class:`Call` records on
one clock (seconds), then :func:`build_program` turns them into
:class:`~mori.traces.model.Step` s. For call *i* and the program's next call *n*:

* ``t_req`` is when the request was sent (the line that triggered it: the last tool
  result or typed prompt before it), ``t_end`` the last line of its response.
* The step's *interval* is ``n.t_req - t_req``; it is split into the call's time and the
  gap, so that ``call_s + gap_s`` (plus any subagent wait) ends exactly where the next
  request starts.
* Kind and gap: ``HUMAN`` if a person acted after the response (a typed prompt, an
  interruption, a slash command): the gap runs from the response's last line to the next
  request. Else ``TOOL``: the gap is the longest of the call's tool calls, each measured
  from its use to its result (parallel calls overlap, so the longest is what the program
  waited); with no timed tool call, from the response's last line to the next request.
  Gaps are clipped to ``[0, interval]``; ``call_s = interval - gap``.
* Subagents (and compactions) spawned after the call become its
  :class:`~mori.traces.model.SubagentSpawn` s: the response is taken to end at
  ``min(t_end, first spawn)``; ``delay_s`` is each spawn's time after that; the gap is
  the residual from the last subagent's end (spawn + its own span) to the next request.
  The kind is ``SUBAGENT`` when the parent called a subagent as a tool (``waited``),
  ``HUMAN`` when a person acted, else ``TOOL``.
* The last call: ``call_s = t_end - t_req``, gap 0, kind ``END`` (``SUBAGENT`` if it
  waited on subagents).
* ``reuse_tokens``: 0 for the first call; then the recorded cache hit (``cached``),
  capped by this prompt and the previous one (a prefix of the previous prompt cannot be
  longer than it). ``new_tokens``: the recorded uncached prompt tokens, capped by the
  prompt.
* Durations are rounded to the microsecond (timestamps are at most that precise), and
  never negative.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn


@dataclass(slots=True)
class ToolCall:
    """One tool call of a response: its name, use and result times (``end`` unknown
    while no result has been seen)."""

    name: str
    start: float
    end: float | None = None


@dataclass(slots=True)
class Spawn:
    """A program started during a call's gap: when, the program, its own span (first
    request to last response end), and whether the parent called it as a tool."""

    t: float
    program: ProgramTrace
    span_s: float
    waited: bool


@dataclass(slots=True)
class Call:
    """One LLM call as recorded (absolute seconds; tokens as the usage says)."""

    t_req: float
    t_end: float
    prompt: int
    output: int
    cached: int | None = None
    new: int | None = None
    tools: list[ToolCall] = field(default_factory=list)
    human: bool = False
    spawns: list[Spawn] = field(default_factory=list)


def span_s(calls: list[Call]) -> float:
    """Seconds from the first request to the last response's end (0 if no call)."""
    if not calls:
        return 0.0
    return max(0.0, max(c.t_end for c in calls) - calls[0].t_req)


def build_program(
    name: str, source: str, calls: list[Call], shared_prefix_tokens: int = 0,
    provider: str = "",
) -> ProgramTrace:
    """The program made of ``calls`` (in request order) by the rules of the module doc,
    recorded by ``provider`` (``"claude"``, ``"codex"`` or ``""``)."""
    steps: list[Step] = []
    for index, call in enumerate(calls):
        nxt = calls[index + 1] if index + 1 < len(calls) else None
        prev = calls[index - 1] if index > 0 else None
        steps.append(_step(call, prev, nxt))
    return ProgramTrace(
        name=name, steps=tuple(steps), shared_prefix_tokens=shared_prefix_tokens, source=source,
        provider=provider,
    )


def _step(call: Call, prev: Call | None, nxt: Call | None) -> Step:
    t_end = max(call.t_end, call.t_req)
    spawns = sorted(call.spawns, key=lambda s: s.t)
    waited = any(s.waited for s in spawns)
    response_end = t_end
    if spawns:
        response_end = max(call.t_req, min(t_end, spawns[0].t))
    if nxt is None:
        call_s = response_end - call.t_req
        gap = 0.0
        kind = GapKind.SUBAGENT if waited else GapKind.END
    else:
        interval = max(0.0, nxt.t_req - call.t_req)
        if spawns:
            call_s = min(interval, response_end - call.t_req)
            last_end = max(s.t + s.span_s for s in spawns)
            gap = max(0.0, nxt.t_req - max(last_end, call.t_req + call_s))
        else:
            if call.human:
                candidate = nxt.t_req - t_end
            else:
                waits = [t.end - t.start for t in call.tools if t.end is not None]
                candidate = max(waits) if waits else nxt.t_req - t_end
            gap = min(interval, max(0.0, candidate))
            call_s = interval - gap
        if call.human:
            kind = GapKind.HUMAN
        elif waited:
            kind = GapKind.SUBAGENT
        else:
            kind = GapKind.TOOL
    reuse = 0
    if prev is not None and call.cached is not None:
        reuse = max(0, min(call.cached, prev.prompt, call.prompt))
    new = None if call.new is None else max(0, min(call.new, call.prompt))
    return Step(
        prompt_tokens=call.prompt,
        output_tokens=call.output,
        gap_s=_us(gap),
        gap_kind=kind,
        reuse_tokens=reuse,
        subagents=tuple(
            SubagentSpawn(_us(s.t - response_end), s.program) for s in spawns
        ),
        new_tokens=new,
        call_s=_us(call_s),
        tool_names=tuple(t.name for t in call.tools),
    )


def _us(seconds: float) -> float:
    """``seconds`` rounded to the microsecond, at least 0."""
    return max(0.0, round(seconds, 6))
