"""What the controller tells the trace recorder (``mori serve --record``): each
program's start (its agent, session and parent), each step as the gateway saw it, and
each end, on the Unix clock.

The recorder itself, which builds the trace and writes the file, is
``mori.gateway.record.TraceRecorder``; this is the controller's side of it. Anonymous and
side programs are not recorded. A step, an end or the close that fails is logged: the
recording never takes serving down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mori.gateway.agents import AgentTrack, StepFacts
from mori.gateway.programs import ProgramInfo
from mori.gateway.record import StepRecord, TraceRecorder

log = logging.getLogger("mori.gateway")


class Recording:
    """The recorder of ``--record`` (``recorder``; None: not recording) and the Unix
    time of the controller's wall clock (``epoch``)."""

    __slots__ = ("recorder", "_wall", "_epoch_offset")

    def __init__(self, wall: Callable[[], float],
                 recorder: TraceRecorder | None = None) -> None:
        self.recorder = recorder  # set by the gateway (--record)
        self._wall = wall
        self._epoch_offset = time.time() - wall()

    def epoch(self, wall: float) -> float:
        """Unix time of a wall-clock reading (the recorded trace's clock)."""
        return wall + self._epoch_offset

    def start(self, program_id: str, track: AgentTrack) -> None:
        """A program of an agent began (not a side request)."""
        if self.recorder is not None:
            self.recorder.start(program_id, recogniser=track.recogniser, agent=track.agent,
                                session=track.session, parent=track.parent,
                                at=self.epoch(self._wall()))

    def step(self, info: ProgramInfo, s: StepFacts) -> None:
        """A step of ``info``'s program ended; ``s``: what its answer said."""
        if self.recorder is None:
            return
        prompt = s.prompt_tokens if s.prompt_tokens is not None else info.prompt_tokens
        output = s.output_tokens if s.output_tokens is not None else max(
            0, info.context_tokens - prompt)
        rec = StepRecord(arrival=self.epoch(info.arrived_wall or info.last_seen),
                         ended=self.epoch(info.last_seen), prompt_tokens=prompt,
                         cached_tokens=s.cached_tokens, output_tokens=output,
                         tool_names=s.tool_names, text=info.text)
        try:
            self.recorder.step(info.program_id, rec)
        except Exception:  # recording must never take serving down
            log.exception("recording a step of %s failed", info.program_id)

    def end(self, program_id: str) -> None:
        """A recorded program ended."""
        if self.recorder is None:
            return
        try:
            self.recorder.end(program_id, self.epoch(self._wall()))
        except Exception:
            log.exception("recording the end of %s failed", program_id)

    def close(self) -> None:
        """Close the recorder (the gateway stops): what it holds is written."""
        if self.recorder is None:
            return
        try:
            self.recorder.close(self.epoch(self._wall()))
        except Exception:
            log.exception("closing the recorded trace failed")
        self.recorder = None
