"""The closed-loop replay rules, shared by the simulator and the live replay client.

Pure: no clock, no I/O. Whoever drives a :class:`ReplayPlan` (the discrete-event
simulator, or ``mori replay`` against a live endpoint) supplies the time:

- The traces are prepared once (context window and human-gap rules,
  :func:`mori.sim.workload.prepare`).
- A seeded RNG shuffles the order in which traces are taken, then draws one start time
  per slot, uniform in ``[0, stagger_s]`` (no draw when ``stagger_s`` is 0), in that
  order: the shuffle first, then slot 0, 1, ...
- A slot starting (at its start time, or when its program ends) takes the next trace in
  that order, cycling; every program instance, subagents included, gets the id
  ``f"{trace.name}#{k}"``, k counting instances from 1 in the order they start.
- Closed loop: a program sends its next request only after its previous response and
  the step's recorded gap. A step with subagents spawns each at its recorded delay after
  the response; the parent waits for all of them, then for the step's residual gap.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from mori.sim.workload import prepare
from mori.traces.model import ProgramTrace, Step, SubagentSpawn


@dataclass(frozen=True, slots=True)
class NextStep:
    """What follows a finished step: the program's end, a gap, or subagents.

    ``end``: the step was the program's last. Otherwise, with ``subagents`` the program
    spawns each at its ``delay_s`` and waits for all of them (then
    :meth:`ProgramRun.subagent_ended` gives the residual gap); without, it sends its next
    request after ``gap_s``.
    """

    end: bool
    gap_s: float = 0.0
    subagents: tuple[SubagentSpawn, ...] = ()


_END = NextStep(end=True)


@dataclass(slots=True, eq=False)
class ProgramRun:
    """One running instance of a program: where it is in its trace.

    ``slot``: the closed-loop slot a top-level program occupies (None for a subagent);
    ``parent``: the program that spawned this one (None for a top-level program).
    """

    pid: str
    trace: ProgramTrace
    slot: int | None
    parent: ProgramRun | None = None
    step: int = 0
    pending_subs: int = 0

    @property
    def current(self) -> Step:
        """The step whose request is to be sent (or is in flight)."""
        return self.trace.steps[self.step]

    def advance(self) -> NextStep:
        """The current step's response finished: move on and say what follows."""
        step = self.trace.steps[self.step]
        self.step += 1
        if self.step >= len(self.trace.steps):
            return _END
        if step.subagents:
            self.pending_subs = len(step.subagents)
            return NextStep(end=False, subagents=step.subagents)
        return NextStep(end=False, gap_s=step.gap_s)

    def subagent_ended(self) -> float | None:
        """One of this program's subagents ended: the residual gap before its next
        request once the last one has, else None."""
        self.pending_subs -= 1
        if self.pending_subs == 0:
            return self.trace.steps[self.step - 1].gap_s
        return None


@dataclass(slots=True)
class ReplayPlan:
    """The prepared programs, the seeded trace order and slot start times, and the
    instance cursor of one run. Build one per run (it counts the instances it starts).

    ``programs`` may be empty (nothing fits ``max_context``); callers refuse that with
    their own message. ``left_out``: programs dropped entirely by the context rule.
    """

    programs: list[ProgramTrace]
    left_out: int
    order: list[int]
    start_times: list[float]
    cursor: int = 0
    instances: int = 0

    @classmethod
    def build(cls, programs: Sequence[ProgramTrace], *, slots: int, seed: int,
              stagger_s: float, max_context: int, human_gap: str,
              human_gap_cap_s: float) -> ReplayPlan:
        """Prepare ``programs`` and draw the order and the ``slots`` start times."""
        kept, left_out = prepare(tuple(programs), max_context, human_gap, human_gap_cap_s)
        rng = random.Random(seed)
        order = list(range(len(kept)))
        rng.shuffle(order)
        starts = [rng.uniform(0.0, stagger_s) if stagger_s else 0.0 for _ in range(slots)]
        return cls(kept, left_out, order, starts)

    def next_trace(self) -> ProgramTrace:
        """The trace the next slot to start takes (the order cycles)."""
        trace = self.programs[self.order[self.cursor % len(self.order)]]
        self.cursor += 1
        return trace

    def instance_id(self, trace: ProgramTrace) -> str:
        """The id of a new instance of ``trace``: ``f"{trace.name}#{k}"``, k = 1, 2, ..."""
        self.instances += 1
        return f"{trace.name}#{self.instances}"

    def start(self, trace: ProgramTrace, slot: int | None,
              parent: ProgramRun | None = None) -> ProgramRun:
        """A new instance of ``trace`` (see :meth:`instance_id`)."""
        return ProgramRun(self.instance_id(trace), trace, slot, parent)

    def start_slot(self, slot: int) -> ProgramRun:
        """The next trace, started in ``slot``."""
        return self.start(self.next_trace(), slot, None)
