"""The generator reports what was asked, within the stated tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest

from mori.traces import GapKind, read_traceset, write_traceset
from mori.traces.stats import analyze
from mori.traces.synth import SynthSpec, synthesize


def _phase(stats, threshold: float):  # type: ignore[no-untyped-def]
    return {p.threshold_s: p.durations for p in stats.main.busy_phases}[threshold]


@pytest.mark.parametrize(("programs", "seed"), [(20, 0), (20, 7), (60, 3)])
def test_paper_defaults_within_tolerance(programs: int, seed: int) -> None:
    spec = SynthSpec(programs=programs, seed=seed)
    stats = analyze(synthesize(spec), threshold_s=spec.threshold_s)
    assert stats.main.programs == programs and stats.subagents is None
    assert stats.main.short_calls_frac == pytest.approx(0.87, abs=0.01)
    assert stats.main.short_time_frac == pytest.approx(0.42, abs=0.01)
    phases = _phase(stats, 2.0)
    assert phases.median == pytest.approx(20.0, rel=0.05)
    assert phases.p90 == pytest.approx(81.0, rel=0.05)
    assert stats.main.first_prompt.median == pytest.approx(spec.first_prompt_median, rel=0.15)
    assert stats.main.growth_per_call.median == pytest.approx(spec.growth_per_call, rel=0.15)


def test_other_statistics_are_honoured() -> None:
    spec = SynthSpec(programs=30, seed=5, threshold_s=1.0, short_calls_frac=0.75,
                     short_time_frac=0.3, busy_median_s=30.0, busy_p90_s=120.0,
                     short_gap_median_s=0.2, growth_per_call=2500.0)
    stats = analyze(synthesize(spec), threshold_s=1.0)
    assert stats.main.short_calls_frac == pytest.approx(0.75, abs=0.01)
    assert stats.main.short_time_frac == pytest.approx(0.3, abs=0.01)
    assert _phase(stats, 1.0).median == pytest.approx(30.0, rel=0.05)
    assert _phase(stats, 1.0).p90 == pytest.approx(120.0, rel=0.05)
    assert stats.main.growth_per_call.median == pytest.approx(2500.0, rel=0.15)


def test_seeded_and_valid(tmp_path: Path) -> None:
    a = synthesize(SynthSpec(programs=5, seed=1))
    assert a == synthesize(SynthSpec(programs=5, seed=1))
    assert a != synthesize(SynthSpec(programs=5, seed=2))
    for program in a.programs:
        assert program.steps[-1].gap_kind is GapKind.END
        assert all(s.gap_kind is GapKind.TOOL for s in program.steps[:-1])
        assert all(0 <= s.reuse_tokens <= s.prompt_tokens for s in program.steps)
    write_traceset(a, tmp_path / "s.jsonl.gz")
    assert read_traceset(tmp_path / "s.jsonl.gz") == a


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"programs": 0}, "programs"),
    ({"short_calls_frac": 1.0}, "short_calls_frac"),
    ({"busy_p90_s": 10.0}, "busy_p90_s"),
    ({"short_time_frac": 0.95}, "infeasible"),
])
def test_bad_specs(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        synthesize(SynthSpec(**kwargs))  # type: ignore[arg-type]


def test_provider_labels_the_programs(tmp_path: Path) -> None:
    ts = synthesize(SynthSpec(programs=3, seed=1, provider="codex"))
    assert {p.provider for p in ts.programs} == {"codex"}
    assert {p.provider for p in synthesize(SynthSpec(programs=3)).programs} == {""}
    write_traceset(ts, tmp_path / "c.jsonl")
    assert read_traceset(tmp_path / "c.jsonl") == ts
