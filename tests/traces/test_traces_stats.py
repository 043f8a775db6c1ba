"""The workload analysis on hand-made programs with known answers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mori.traces import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet, default_traces
from mori.traces.stats import (
    analyze,
    analyze_by_provider,
    busy_phases,
    context_growth,
    format_stats,
    idle_fractions,
    percentile,
    providers,
    select_provider,
    span_s,
    to_json,
    wait_s,
)

T, H, S, E = GapKind.TOOL, GapKind.HUMAN, GapKind.SUBAGENT, GapKind.END


def _p(name: str, rows: list[tuple[int, float, float, GapKind]],
       spawns: dict[int, tuple[SubagentSpawn, ...]] | None = None) -> ProgramTrace:
    spawns = spawns or {}
    return ProgramTrace(name, tuple(
        Step(prompt, 10, gap, kind, call_s=call, subagents=spawns.get(i, ()))
        for i, (prompt, call, gap, kind) in enumerate(rows)))


SUB = _p("main/sub", [(500, 1.0, 0.5, T), (600, 2.0, 0.0, E)])  # span 3.5 s
MAIN = _p("main", [
    (1000, 2.0, 0.5, T),   # short
    (1100, 3.0, 1.5, T),   # short
    (1200, 1.0, 10.0, T),  # long
    (1300, 4.0, 100.0, H),  # human
    (2000, 2.0, 0.25, S),  # waits 0.25 + 3.5 + 0.25 = 4.0 (long)
    (2500, 1.0, 0.0, E),
], {4: (SubagentSpawn(0.25, SUB),)})


def test_waits_and_spans() -> None:
    assert span_s(SUB) == pytest.approx(3.5)
    assert wait_s(MAIN.steps[4]) == pytest.approx(4.0)
    assert wait_s(MAIN.steps[5]) == 0.0


def test_busy_phases_and_idle() -> None:
    # phases split at waits >= 2 s: [2+0.5+3+1.5+1], [4], [2], [1]
    assert busy_phases(MAIN, 2.0) == pytest.approx([8.0, 4.0, 2.0, 1.0])
    # at 1 s, 1.5 s splits too
    assert busy_phases(MAIN, 1.0) == pytest.approx([5.5, 1.0, 4.0, 2.0, 1.0])
    idle, with_human = idle_fractions(MAIN)  # type: ignore[misc]
    assert idle == pytest.approx(16.0 / (16.0 + 13.0))
    assert with_human == pytest.approx(116.0 / 129.0)


def test_context_growth() -> None:
    assert context_growth(MAIN) == (1000, 2500, 300.0)
    assert context_growth(_p("one", [(7, 1.0, 0.0, E)])) == (7, 7, None)


def test_analyze_shares_and_populations() -> None:
    stats = analyze(TraceSet("t", (MAIN,)), threshold_s=2.0)
    main = stats.main
    assert main.tool_gaps.n == 4  # three TOOL steps and one SUBAGENT wait
    assert main.short_calls_frac == pytest.approx(0.5)
    assert main.short_time_frac == pytest.approx(2.0 / 16.0)
    assert main.human_gaps.n == 1 and main.human_gaps.total == 100.0
    assert main.llm_calls.median == 6
    assert stats.subagents is not None and stats.subagents.programs == 1
    assert stats.subagents.tool_gaps.n == 1
    phases = {p.threshold_s: p.durations for p in main.busy_phases}
    assert sorted(phases) == [1.0, 2.0, 5.0]
    assert phases[2.0].median == pytest.approx(3.0)
    # at 5 s only the 10 s and the human 100 s waits split: [8], [4], [2 + 4 + 1]
    assert phases[5.0].n == 3 and phases[5.0].total == pytest.approx(19.0)


def test_percentile() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert math.isnan(percentile([], 0.5))


def test_report_and_json_on_default_traces() -> None:
    stats = analyze(default_traces())
    text = format_stats(stats)
    assert "87 %" in text and "42 %" in text and "~20 / ~81" in text
    data = to_json(stats)
    assert data["paper"]["short_calls_frac"] == 0.87  # type: ignore[index]
    main = data["main"]
    assert isinstance(main, dict) and main["programs"] == 31
    with pytest.raises(ValueError, match="threshold"):
        analyze(default_traces(), threshold_s=0)


CODEX = replace(_p("codex", [(3000, 0.5, 0.1, T), (3200, 0.5, 30.0, T), (3500, 0.5, 0.0, E)]),
                provider="codex")
CLAUDE = replace(MAIN, provider="claude")
OTHER = replace(_p("other", [(800, 1.0, 0.2, T), (900, 1.0, 0.0, E)]), provider="claude")
MIXED = TraceSet("mixed", (CLAUDE, CODEX, OTHER))


def test_providers_are_sorted_unknown_last() -> None:
    assert providers(MIXED) == ("claude", "codex")
    assert providers(TraceSet("u", (MAIN, CODEX))) == ("codex", "unknown")
    assert analyze(MIXED).providers == ("claude", "codex")
    assert select_provider(TraceSet("u", (MAIN, CODEX)), "").programs == (MAIN,)
    with pytest.raises(ValueError, match="'gemini'.*providers: claude, codex"):
        select_provider(MIXED, "gemini")


def test_split_by_provider_equals_each_provider_alone() -> None:
    by = analyze_by_provider(MIXED, threshold_s=2.0)
    assert list(by) == ["claude", "codex"]
    alone = {"claude": TraceSet("mixed", (CLAUDE, OTHER)), "codex": TraceSet("mixed", (CODEX,))}
    for name, ts in alone.items():
        assert to_json(by[name]) == to_json(analyze(ts, threshold_s=2.0))
    assert by["claude"].main.programs == 2 and by["codex"].main.programs == 1
    assert by["codex"].subagents is None and by["claude"].subagents is not None
    assert by["codex"].main.short_calls_frac == pytest.approx(0.5)
    assert by["claude"].main.short_calls_frac == pytest.approx(3 / 5)
    assert analyze(MIXED).main.short_calls_frac == pytest.approx(4 / 7)


def test_json_by_provider_only_when_mixed() -> None:
    stats = analyze(MIXED)
    data = to_json(stats, analyze_by_provider(MIXED))
    assert data["providers"] == ["claude", "codex"]
    split = data["by_provider"]
    assert isinstance(split, dict) and sorted(split) == ["claude", "codex"]
    assert split["codex"]["main"] == to_json(analyze(TraceSet("c", (CODEX,))))["main"]
    assert split["codex"]["subagents"] is None
    assert split["claude"]["subagents"]["programs"] == 1
    assert data["main"] == to_json(stats)["main"]  # the existing keys are kept
    one = TraceSet("one", (CODEX,))
    assert "by_provider" not in to_json(analyze(one), analyze_by_provider(one))


def test_text_has_a_column_per_provider() -> None:
    text = format_stats(analyze(MIXED), by_provider=analyze_by_provider(MIXED))
    lines = text.splitlines()
    assert lines[0].endswith("providers claude, codex")
    heads = [line.split() for line in lines if line.startswith(("top-level", "subagents"))]
    assert heads[0][-4:] == ["all", "claude", "codex", "paper"]
    assert heads[1][-3:] == ["all", "claude", "codex"]  # no paper column for subagents
    programs = next(line for line in lines if line.startswith("programs"))
    assert programs.split() == ["programs", "3", "2", "1", "532"]
    one = format_stats(analyze(TraceSet("c", (CODEX,))))
    assert one.splitlines()[0].endswith("provider codex") and "this set" in one
    assert "provider" not in format_stats(analyze(TraceSet("t", (MAIN,)))).splitlines()[0]
