"""The canonical in-memory trace: programs made of steps.

One model for the whole project: every importer produces it, the simulator and the
replay client consume it. A *step* is one LLM call followed by the gap before the
program's next call. A subagent is a program of its own, spawned during its parent's
gap; to the parent, the subagent's life is part of one long tool call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class GapKind(StrEnum):
    """What the program was doing in the gap after a step."""

    TOOL = "tool"  # a tool call (the response stopped for tool_use)
    HUMAN = "human"  # a final answer, then a person's next prompt (or an unknown stop)
    SUBAGENT = "subagent"  # waiting for spawned subagents (plus any residual tool time)
    END = "end"  # the last step of the program: no gap follows


@dataclass(frozen=True, slots=True)
class SubagentSpawn:
    """A subagent started during its parent's gap.

    ``delay_s`` is the time from the end of the parent's response to the spawn.
    """

    delay_s: float
    program: ProgramTrace


@dataclass(frozen=True, slots=True)
class Step:
    """One LLM call and the gap after it.

    ``reuse_tokens``: how many leading tokens of this prompt equal a prefix of the previous
    prompt of the same program (block-granular, from the block hashes; 0 for the first
    step). The rest of the prompt is new and must be computed in any case.
    ``gap_s``: seconds from the end of this step's response to the next request. When the
    step spawns subagents it is the residual time after the last subagent ends (the parent
    waits for them first).

    Optional, recorded when the source knows them (``None`` / empty otherwise; the
    simulator does not read them):

    * ``new_tokens``: prompt tokens the recording says were not served from a prefix cache
      (Claude Code: ``input + cache_creation``; Codex: ``input - cached_input``).
    * ``call_s``: seconds from the request to the end of its response (the program's
      reasoning time in this step), as recorded.
    * ``tool_names``: the tools the response called, in call order (repeats kept).
    * ``block_hashes``: one id per ``ProgramTrace.block_size`` tokens of the prompt,
      chained (equal ids mean an equal prefix).
    """

    prompt_tokens: int
    output_tokens: int
    gap_s: float
    gap_kind: GapKind
    reuse_tokens: int = 0
    subagents: tuple[SubagentSpawn, ...] = ()
    new_tokens: int | None = None
    call_s: float | None = None
    tool_names: tuple[str, ...] = ()
    block_hashes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError(f"negative token count in {self!r}")
        if self.gap_s < 0:
            raise ValueError(f"negative gap in {self!r}")
        if not 0 <= self.reuse_tokens <= self.prompt_tokens:
            raise ValueError(f"reuse_tokens outside [0, prompt_tokens] in {self!r}")
        if self.new_tokens is not None and not 0 <= self.new_tokens <= self.prompt_tokens:
            raise ValueError(f"new_tokens outside [0, prompt_tokens] in {self!r}")
        if self.call_s is not None and self.call_s < 0:
            raise ValueError(f"negative call_s in {self!r}")


@dataclass(frozen=True, slots=True)
class ProgramTrace:
    """A recorded agent program.

    ``shared_prefix_tokens``: the tools + system prefix (the first tokens of every prompt)
    that real deployments share across conversations; 0 when unknown.
    ``block_size``: tokens per entry of the steps' ``block_hashes``; ``None`` when the
    program carries no hashes.
    """

    name: str
    steps: tuple[Step, ...]
    shared_prefix_tokens: int = 0
    source: str = ""
    block_size: int | None = None

    @property
    def peak_context_tokens(self) -> int:
        return max((s.prompt_tokens + s.output_tokens for s in self.steps), default=0)

    def all_programs(self) -> list[ProgramTrace]:
        """This program and every subagent below it, depth first."""
        out: list[ProgramTrace] = [self]
        for step in self.steps:
            for sub in step.subagents:
                out.extend(sub.program.all_programs())
        return out


@dataclass(frozen=True, slots=True)
class TraceSet:
    """A named collection of top-level programs (subagents hang below their parents)."""

    name: str
    programs: tuple[ProgramTrace, ...] = field(default_factory=tuple)

    def __len__(self) -> int:
        return len(self.programs)
