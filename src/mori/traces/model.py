"""The canonical in-memory trace: programs made of steps.

One model for the whole project: every importer produces it, the simulator and the
replay client consume it. A *step* is one LLM call followed by the gap before the
program's next call. A subagent is a program of its own, spawned during its parent's
gap; to the parent, the subagent's life is part of one long tool call.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, overload

_INT64 = (-(2**63), 2**63 - 1)


class BlockHashes(Sequence[int]):
    """A step's block hashes, stored compactly: 8 bytes a hash in one ``array('q')``
    instead of a Python int object and a pointer each (a trace with hashes holds millions
    of them). Immutable; compares equal to any sequence of the same integers (a tuple
    included) and hashes like the tuple of them."""

    __slots__ = ("_a",)

    def __init__(self, values: Iterable[int]) -> None:
        self._a = array("q", values)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> BlockHashes: ...
    def __getitem__(self, i: int | slice) -> int | BlockHashes:
        if isinstance(i, slice):
            return BlockHashes(self._a[i])
        return self._a[i]

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[int]:
        return iter(self._a)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockHashes):
            return self._a == other._a
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self._a) and all(
                a == b for a, b in zip(self._a, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._a))

    def __repr__(self) -> str:
        return f"BlockHashes({list(self._a)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (BlockHashes, (list(self._a),))


def block_hashes(values: Iterable[int]) -> Sequence[int]:
    """``values`` in the compact form (:class:`BlockHashes`), or as a tuple when some do
    not fit a signed 64-bit integer."""
    values = list(values)
    lo, hi = _INT64
    if all(lo <= v <= hi for v in values):
        return BlockHashes(values)
    return tuple(values)


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
      chained (equal ids mean an equal prefix); importers and readers store them as
      :func:`block_hashes` makes them (compact).
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
    block_hashes: Sequence[int] | None = None

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
    ``provider``: the agent that recorded it, ``"claude"`` (Claude Code) or ``"codex"``
    (Codex CLI), or ``""`` when unknown; ``mori trace stats`` splits its figures by it.
    """

    name: str
    steps: tuple[Step, ...]
    shared_prefix_tokens: int = 0
    source: str = ""
    block_size: int | None = None
    provider: str = ""

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
