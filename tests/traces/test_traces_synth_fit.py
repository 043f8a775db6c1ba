"""Fitting a SynthSpec to a trace set, and ``mori trace synth --like``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mori.cli.trace_cmd import main
from mori.traces import TraceSet, default_traces, read_traceset, write_traceset
from mori.traces.stats import TraceStats, analyze
from mori.traces.synth import SynthSpec, synthesize
from mori.traces.synth_fit import describe, fit_spec, short_time_cap, with_overrides

OTHER = SynthSpec(programs=30, seed=4, short_calls_frac=0.75, short_time_frac=0.25,
                  busy_median_s=12.0, busy_p90_s=60.0, provider="codex")


def _busy(stats: TraceStats, threshold: float) -> tuple[float, float]:
    d = {p.threshold_s: p.durations for p in stats.main.busy_phases}[threshold]
    return d.median, d.p90


def _close(a: TraceStats, b: TraceStats, threshold: float) -> None:
    """``b`` within the fit's tolerance of ``a``: shares 2 points, busy phases 10 %."""
    assert b.main.short_calls_frac == pytest.approx(a.main.short_calls_frac, abs=0.02)
    assert b.main.short_time_frac == pytest.approx(a.main.short_time_frac, abs=0.02)
    assert _busy(b, threshold) == pytest.approx(_busy(a, threshold), rel=0.10)


@pytest.mark.parametrize("spec", [
    SynthSpec(programs=30, seed=1),
    SynthSpec(programs=25, seed=6, threshold_s=1.0, short_calls_frac=0.7,
              short_time_frac=0.3, busy_median_s=30.0, busy_p90_s=150.0,
              short_gap_median_s=0.2),
    OTHER,
])
def test_fit_recovers_the_spec(spec: SynthSpec) -> None:
    fitted = fit_spec(synthesize(spec), threshold_s=spec.threshold_s, seed=11)
    fitted.check()
    assert fitted.programs == spec.programs and fitted.seed == 11
    assert fitted.provider == spec.provider
    assert fitted.short_calls_frac == pytest.approx(spec.short_calls_frac, abs=0.02)
    assert fitted.short_time_frac == pytest.approx(spec.short_time_frac, abs=0.02)
    assert fitted.busy_median_s == pytest.approx(spec.busy_median_s, rel=0.10)
    assert fitted.busy_p90_s == pytest.approx(spec.busy_p90_s, rel=0.10)
    assert fitted.growth_per_call == pytest.approx(spec.growth_per_call, rel=0.15)
    assert fitted.first_prompt_median == pytest.approx(spec.first_prompt_median, rel=0.15)
    assert fitted.max_context >= 2 * fitted.first_prompt_median
    source = analyze(synthesize(spec), spec.threshold_s)
    _close(source, analyze(synthesize(fitted), spec.threshold_s), spec.threshold_s)


def test_fit_to_one_provider_of_a_mixed_set() -> None:
    claude = synthesize(SynthSpec(programs=20, seed=2, provider="claude"))
    codex = synthesize(OTHER)
    mixed = TraceSet("mixed", claude.programs + codex.programs)
    fitted = fit_spec(mixed, provider="codex", programs=40)
    assert fitted.programs == 40 and fitted.provider == "codex"
    assert fitted.short_calls_frac == pytest.approx(0.75, abs=0.02)
    assert fitted.busy_median_s == pytest.approx(12.0, rel=0.10)
    assert fit_spec(mixed).provider == ""  # mixed: no label
    with pytest.raises(ValueError, match="'gemini'.*providers: claude, codex"):
        fit_spec(mixed, provider="gemini")


def test_clamps_make_a_valid_spec_of_real_traces() -> None:
    # whole-second kv-cache-tester times: ~0.2 % of calls under 2 s, ~0 % of tool time
    fitted = fit_spec(default_traces())
    fitted.check()
    assert fitted.short_calls_frac == 0.01
    assert 0 < fitted.short_time_frac <= short_time_cap(fitted)
    assert fitted.busy_p90_s > fitted.busy_median_s
    stats = analyze(synthesize(fitted))
    assert _busy(stats, 2.0) == pytest.approx((fitted.busy_median_s, fitted.busy_p90_s),
                                             rel=0.05)
    with pytest.raises(ValueError, match="nothing to fit"):
        fit_spec(TraceSet("empty"))


def test_overrides_win_and_fitted_fields_make_room() -> None:
    fitted = fit_spec(synthesize(OTHER))
    spec = with_overrides(fitted, {"busy_median_s": 100.0, "first_prompt_median": 500_000})
    assert spec.busy_median_s == 100.0
    assert spec.busy_p90_s / 100.0 == pytest.approx(fitted.busy_p90_s / fitted.busy_median_s)
    assert spec.max_context == 1_000_000 and spec.first_prompt_median == 500_000
    assert with_overrides(fitted, {"busy_p90_s": 5.0}).busy_median_s < 5.0
    capped = with_overrides(fitted, {"short_calls_frac": 0.2})
    assert capped.short_time_frac == pytest.approx(short_time_cap(capped))
    assert capped.short_time_frac < fitted.short_time_frac
    text = describe(spec, {"busy_median_s"})
    assert "busy_median_s" in text and text.count("\n") == 19
    assert "given" in text.splitlines()[5] and "fitted" in text.splitlines()[6]
    assert "default" in text.splitlines()[10]  # short_gap_sigma


def _stats_of(path: Path, capsys: pytest.CaptureFixture[str],
              *extra: str) -> dict[str, object]:
    assert main(["trace", "stats", str(path), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_synth_like_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "src.jsonl.gz", tmp_path / "like.jsonl"
    write_traceset(synthesize(OTHER), src)
    assert main(["trace", "synth", "--like", str(src), "--seed", "9", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "spec fitted to" in err and f"wrote {out}" in err
    assert any(line.split()[0] == "short_calls_frac" and line.endswith("fitted")
               for line in err.splitlines()[1:-1])
    assert any(line.split()[0] == "seed" and line.endswith("given")
               for line in err.splitlines())
    ts = read_traceset(out)
    assert len(ts) == OTHER.programs and {p.provider for p in ts.programs} == {"codex"}
    a, b = _stats_of(src, capsys)["main"], _stats_of(out, capsys)["main"]
    assert isinstance(a, dict) and isinstance(b, dict)
    for key in ("short_calls_frac", "short_time_frac"):
        assert b[key] == pytest.approx(a[key], abs=0.02)
    _close(analyze(read_traceset(src)), analyze(ts), 2.0)


def test_synth_like_explicit_flags_override(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "src.jsonl", tmp_path / "o.jsonl"
    write_traceset(synthesize(OTHER), src)
    assert main(["trace", "synth", "--like", str(src), "--short-calls", "0.8",
                 "--busy-p90", "90", "--programs", "25", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert any(line.split()[:2] == ["short_calls_frac", "0.8"] and line.endswith("given")
               for line in err.splitlines())
    stats = analyze(read_traceset(out))
    assert stats.main.programs == 25
    assert stats.main.short_calls_frac == pytest.approx(0.8, abs=0.01)
    assert _busy(stats, 2.0) == pytest.approx((12.0, 90.0), rel=0.10)


def test_synth_like_unknown_provider(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, out = tmp_path / "src.jsonl", tmp_path / "o.jsonl"
    write_traceset(synthesize(OTHER), src)
    assert main(["trace", "synth", "--like", str(src), "--provider", "claude",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no program of provider 'claude'" in err and "providers: codex" in err
    assert not out.exists()
    assert main(["trace", "stats", str(src), "--provider", "claude"]) == 2
    assert "providers: codex" in capsys.readouterr().err


def test_synth_without_like_keeps_the_defaults(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.jsonl"
    assert main(["trace", "synth", "--programs", "8", "--seed", "3", "--provider", "claude",
                 "-o", str(out)]) == 0
    assert "fitted" not in capsys.readouterr().err
    want = synthesize(SynthSpec(programs=8, seed=3, provider="claude"))
    assert read_traceset(out) == want


def test_stats_cli_splits_a_mixed_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    claude = synthesize(SynthSpec(programs=6, seed=2, provider="claude"))
    path = tmp_path / "mixed.jsonl"
    write_traceset(TraceSet("mixed", claude.programs + synthesize(OTHER).programs), path)
    data = _stats_of(path, capsys)
    split = data["by_provider"]
    assert isinstance(split, dict) and list(split) == ["claude", "codex"]
    assert split["codex"]["main"]["programs"] == 30
    only = _stats_of(path, capsys, "--provider", "codex")
    assert "by_provider" not in only and only["main"] == split["codex"]["main"]
    assert main(["trace", "stats", str(path)]) == 0
    assert "claude" in capsys.readouterr().out.splitlines()[2]
