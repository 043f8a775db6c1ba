"""bench/bench_dynamo.py's replay plan (the fleet itself runs in tests/e2e)."""

from __future__ import annotations

from bench.bench_dynamo import plan
from mori.traces.model import GapKind, ProgramTrace, Step


def test_the_plan_scales_tokens_and_tool_time_and_never_shrinks_a_context() -> None:
    steps = (Step(prompt_tokens=5000, output_tokens=100, gap_s=10.0, gap_kind=GapKind.TOOL),
             Step(prompt_tokens=3000, output_tokens=4000, gap_s=20.0, gap_kind=GapKind.TOOL),
             Step(prompt_tokens=90000, output_tokens=1, gap_s=0.0, gap_kind=GapKind.TOOL))
    turns = plan([ProgramTrace("t", steps)], steps=3, token_scale=50, time_scale=10,
                 max_tokens=1000, max_output=64)
    (name, ts), = turns.items()
    assert name == "p000"
    assert [t.tokens for t in ts] == [100, 116, 1000]  # grows, capped by the GPU
    assert [t.output for t in ts] == [8, 64, 1]
    assert [t.gap_s for t in ts] == [1.0, 2.0, 0.0]
    assert plan([ProgramTrace("t", steps)], 1, 50, 10, 1000, 64)["p000"][0].tokens == 100
