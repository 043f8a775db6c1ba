"""bench/bench_dynamo.py's replay plan (the fleet itself runs in tests/e2e)."""

from __future__ import annotations

from bench.bench_dynamo import ArmResult, plan, schedule, summarize, table
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


def test_the_plan_caps_each_tool_call() -> None:
    steps = (Step(prompt_tokens=100, output_tokens=1, gap_s=50.0, gap_kind=GapKind.TOOL),
             Step(prompt_tokens=200, output_tokens=1, gap_s=5.0, gap_kind=GapKind.TOOL))
    ts = plan([ProgramTrace("t", steps)], 2, 1, 10, 1000, 64, max_gap_s=2.0)["p000"]
    assert [t.gap_s for t in ts] == [2.0, 0.5]


def test_the_schedule_rotates_the_routers_each_round_within_each_host_ratio() -> None:
    runs = schedule(["mori", "thunderagent", "kv"], [0.0, 1.0], rounds=3)
    assert runs[:9] == [(0.0, 1, "mori"), (0.0, 1, "thunderagent"), (0.0, 1, "kv"),
                        (0.0, 2, "thunderagent"), (0.0, 2, "kv"), (0.0, 2, "mori"),
                        (0.0, 3, "kv"), (0.0, 3, "mori"), (0.0, 3, "thunderagent")]
    assert {r for r, _, _ in runs[9:]} == {1.0} and len(runs) == 18


def test_the_summary_takes_medians_over_rounds_and_the_mori_ratios() -> None:
    results = []
    for rnd, (m, t, k) in enumerate([(10.0, 5.0, 8.0), (12.0, 6.0, 9.0), (30.0, 4.0, 10.0)]):
        for router, tps in (("mori", m), ("thunderagent", t), ("kv", k)):
            results.append(ArmResult(router, 4, 1.0, rnd + 1, turns_per_s=tps))
    rows = summarize(results)
    assert [r["router"] for r in rows] == ["mori", "thunderagent", "kv"]
    assert rows[0]["turns_per_s"] == 12.0 and rows[0]["rounds"] == 3
    assert rows[0]["x_thunderagent"] == 12.0 / 5.0 and rows[0]["x_kv"] == 12.0 / 9.0
    assert "| 1 | MORI | 12.00 |" in table(rows)
