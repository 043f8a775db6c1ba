"""Preparing traces for closed-loop replay: context window, human time, refusals.

Rules (documented in docs/simulate.md):
- Context window: a program's steps are kept while prompt + output fit the model's
  context window (``max_context``); the rest is cut (a real session would have compacted
  there). A program whose first step does not fit is left out.
- Human time: a gap after a final answer (``GapKind.HUMAN``) is a person reading and
  typing, not a tool. ``cap`` (default) limits it to ``human_gap_cap_s``; ``replace``
  substitutes the program's median tool gap (or the cap when it has no tool gaps).
- Token scale (simulator): a prepared program's token counts are multiplied by the
  scale, rounded, at least 1, exactly as ``mori replay --token-scale`` sends them; the
  context-window cut is made before, on the trace's own counts.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn

HUMAN_GAP_RULES = ("cap", "replace")


def prepare_program(p: ProgramTrace, max_context: int, human_gap: str,
                    human_cap_s: float) -> ProgramTrace | None:
    """The program as replayed, or None if not even its first step fits."""
    if human_gap not in HUMAN_GAP_RULES:
        raise ValueError(f"unknown human-gap rule {human_gap!r}; valid: {', '.join(HUMAN_GAP_RULES)}")
    steps: list[Step] = []
    for s in p.steps:
        if s.prompt_tokens + s.output_tokens > max_context:
            break
        steps.append(s)
    if not steps:
        return None
    tool_gaps = [s.gap_s for s in steps if s.gap_kind is GapKind.TOOL]
    human_sub = statistics.median(tool_gaps) if tool_gaps else human_cap_s
    out: list[Step] = []
    for i, s in enumerate(steps):
        gap, kind = s.gap_s, s.gap_kind
        if kind is GapKind.HUMAN:
            gap = min(gap, human_cap_s) if human_gap == "cap" else min(human_sub, human_cap_s)
        subs = tuple(
            SubagentSpawn(sp.delay_s, q)
            for sp in s.subagents
            if (q := prepare_program(sp.program, max_context, human_gap, human_cap_s)) is not None
        )
        if i == len(steps) - 1:
            gap, kind, subs = 0.0, GapKind.END, ()
        elif kind is GapKind.SUBAGENT and not subs:
            kind = GapKind.TOOL
        out.append(replace(s, prompt_tokens=max(1, s.prompt_tokens),
                           output_tokens=max(1, s.output_tokens), gap_s=gap, gap_kind=kind,
                           reuse_tokens=min(s.reuse_tokens, max(1, s.prompt_tokens)),
                           subagents=subs))
    return replace(p, steps=tuple(out))


def prepare(programs: list[ProgramTrace] | tuple[ProgramTrace, ...], max_context: int,
            human_gap: str, human_cap_s: float) -> tuple[list[ProgramTrace], int]:
    """Prepared programs and how many were left out entirely."""
    kept = [q for p in programs
            if (q := prepare_program(p, max_context, human_gap, human_cap_s)) is not None]
    return kept, len(programs) - len(kept)


def scale_tokens(n: int, token_scale: float) -> int:
    """``n`` trace tokens as engine tokens: ``max(1, round(n * token_scale))`` (``n``
    itself at scale 1), the replay client's rounding."""
    return n if token_scale == 1.0 else max(1, round(n * token_scale))


def scale_program(p: ProgramTrace, token_scale: float) -> ProgramTrace:
    """``p`` (prepared) with every token count scaled by :func:`scale_tokens`, its
    subagents' too: prompt and output; the reusable prefix as the replay sends it (0
    stays 0, else at most the scaled prompt); the shared prefix likewise; a recorded
    count of uncached tokens (``new_tokens``) at most the scaled prompt."""
    if token_scale == 1.0:
        return p
    steps = []
    for s in p.steps:
        prompt = scale_tokens(s.prompt_tokens, token_scale)
        reuse = min(scale_tokens(s.reuse_tokens, token_scale), prompt) if s.reuse_tokens else 0
        subs = tuple(SubagentSpawn(sp.delay_s, scale_program(sp.program, token_scale))
                     for sp in s.subagents)
        new = (None if s.new_tokens is None
               else min(scale_tokens(s.new_tokens, token_scale), prompt) if s.new_tokens
               else 0)
        steps.append(replace(s, prompt_tokens=prompt, reuse_tokens=reuse,
                             output_tokens=scale_tokens(s.output_tokens, token_scale),
                             subagents=subs, new_tokens=new))
    shared = (scale_tokens(p.shared_prefix_tokens, token_scale)
              if p.shared_prefix_tokens else 0)
    return replace(p, steps=tuple(steps), shared_prefix_tokens=shared)


def workload_problems(programs: int, duration_s: float, stagger_s: float, human_gap: str,
                      human_gap_cap_s: float, max_context: int | None) -> list[str]:
    """What is wrong with the closed-loop workload settings the simulator and the replay
    client share (empty when nothing is)."""
    problems = []
    if programs < 1:
        problems.append(f"programs must be >= 1 (got {programs})")
    if not duration_s > 0:
        problems.append(f"duration must be > 0 seconds (got {duration_s})")
    if stagger_s < 0:
        problems.append(f"stagger must be >= 0 (got {stagger_s})")
    if human_gap not in HUMAN_GAP_RULES:
        problems.append(f"human-gap rule must be one of {', '.join(HUMAN_GAP_RULES)} "
                        f"(got {human_gap!r})")
    if human_gap_cap_s < 0:
        problems.append(f"human-gap cap must be >= 0 (got {human_gap_cap_s})")
    if max_context is not None and max_context < 1:
        problems.append(f"max context must be >= 1 token (got {max_context})")
    return problems
