"""Fit a :class:`~mori.traces.synth.SynthSpec` to a trace set: pure functions.

:func:`fit_spec` measures on a set's top-level programs (subagents are left out: the
generator makes none) what the generator asks, with :mod:`mori.traces.stats` at the
given threshold; :func:`with_overrides` puts values a user gave beside the fitted ones,
keeping the spec valid; :func:`describe` prints a spec one field a line, saying where
each value came from. ``mori trace synth --like PATH`` chains the three.

The generator calibrates the two shares and the busy-phase median and p90 exactly (at
the fitted threshold), so on a set it can reproduce (its own output, say) they come back
within its tolerance (:mod:`mori.traces.synth`); the other figures follow its model
(log-normal phase counts, prompts and growth) and are only near the source's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import fields, replace
from statistics import NormalDist
from typing import Any

from mori.traces.model import TraceSet
from mori.traces.stats import (
    UNKNOWN_PROVIDER,
    analyze,
    busy_phases,
    percentile,
    providers,
    select_provider,
    tool_waits,
)
from mori.traces.synth import SynthSpec

SHARE_BOUNDS = (0.01, 0.99)
"""Shares are clamped into this range: the generator needs both kinds of tool call."""
LONG_MARGIN = 1.1
"""Fitted short-time shares leave long calls at least this many thresholds on average."""
MIN_P90_RATIO = 1.05
"""A fitted busy-phase p90 is at least this many medians (the generator needs p90 >
median)."""
FITTED_FIELDS = (
    "programs", "seed", "threshold_s", "short_calls_frac", "short_time_frac",
    "busy_median_s", "busy_p90_s", "phases_median", "phases_sigma", "short_gap_median_s",
    "first_prompt_median", "growth_per_call", "output_median", "max_context", "provider",
)
"""The :class:`SynthSpec` fields :func:`fit_spec` sets; the rest keep their defaults."""

_Z90 = NormalDist().inv_cdf(0.9)


def fit_spec(ts: TraceSet, *, threshold_s: float = 2.0, provider: str | None = None,
             programs: int | None = None, seed: int = 0) -> SynthSpec:
    """A spec whose output is like ``ts``'s top-level programs (of ``provider`` only, when
    given: ``ValueError`` naming the providers present if it has none), ``programs`` of
    them (default: as many as the source), generated with ``seed``.

    Measured at ``threshold_s``: the short share of tool calls and of tool time, the
    busy-phase median and p90, the median of busy phases per program (and their spread,
    ``phases_sigma``, from its p90), the median short tool call, the median first prompt,
    the mean growth per call, the median output, and as ``max_context`` the set's
    largest prompt. The generated programs carry the provider fitted to (or the set's
    only one). Clamps, so that :meth:`SynthSpec.check` and the generator accept the spec:

    * shares into :data:`SHARE_BOUNDS` (a set of no short or no long call has no share
      the generator can make); with no tool call at all, the defaults;
    * the short-time share under what the short calls can hold when long calls average
      :data:`LONG_MARGIN` thresholds (:func:`short_time_cap`; real long calls are at
      least one threshold, but the generator draws its own short calls);
    * the busy-phase median to at least 1 ms, the p90 to at least
      :data:`MIN_P90_RATIO` medians; phases per program to at least 1, their sigma
      into [0, 2];
    * the median short call into [1 %, 90 %] of the threshold (``0.2 x threshold``,
      the default's ratio, when no call is short);
    * the first prompt and output to at least 1 token, growth per call to at least 1
      token (the default when no program grows), ``max_context`` to at least twice the
      first prompt.
    """
    if not threshold_s > 0:
        raise ValueError(f"threshold must be positive, got {threshold_s}")
    source = ts if provider is None else select_provider(ts, provider)
    progs = [p for p in source.programs if p.steps]
    if not progs:
        raise ValueError(f"nothing to fit: trace set {ts.name!r} has no LLM call")
    main = analyze(TraceSet(source.name, tuple(progs)), threshold_s, (threshold_s,)).main
    d = SynthSpec()
    phases = next(ph.durations for ph in main.busy_phases if ph.threshold_s == threshold_s)
    busy_median = max(phases.median, 1e-3)
    counts = [float(len(busy_phases(p, threshold_s))) for p in progs]
    short = [w for p in progs for w in tool_waits(p) if w < threshold_s]
    first = max(1, round(main.first_prompt.median))
    growth = main.growth_per_call.mean
    spec = replace(
        d, programs=programs if programs is not None else len(progs), seed=seed,
        threshold_s=threshold_s,
        short_calls_frac=_share(main.short_calls_frac, d.short_calls_frac),
        short_time_frac=_share(main.short_time_frac, d.short_time_frac),
        busy_median_s=busy_median,
        busy_p90_s=max(phases.p90, busy_median * MIN_P90_RATIO),
        phases_median=max(1.0, percentile(counts, 0.5)),
        phases_sigma=_clamp(math.log(percentile(counts, 0.9) / percentile(counts, 0.5))
                            / _Z90, 0.0, 2.0),
        short_gap_median_s=_clamp(percentile(short, 0.5) if short else 0.2 * threshold_s,
                                  0.01 * threshold_s, 0.9 * threshold_s),
        first_prompt_median=first,
        growth_per_call=d.growth_per_call if math.isnan(growth) else max(1.0, growth),
        output_median=max(1, round(percentile([float(s.output_tokens) for p in progs
                                               for s in p.steps], 0.5))),
        max_context=max(max(s.prompt_tokens for p in progs for s in p.steps), 2 * first),
        provider=_label(source, provider))
    return _capped(spec)


def short_time_cap(spec: SynthSpec) -> float:
    """The largest short-time share the generator can give ``spec`` with long calls
    averaging :data:`LONG_MARGIN` thresholds: with ``m`` the mean of its short calls (a
    log-normal of median ``short_gap_median_s`` truncated under the threshold) and
    ``r = m f / (1 - f)`` the short time per long call, ``r / (r + LONG_MARGIN t)``."""
    t, f = spec.threshold_s, spec.short_calls_frac
    mu, s = math.log(spec.short_gap_median_s), spec.short_gap_sigma
    z = (math.log(t) - mu) / s
    nd = NormalDist()
    mean = math.exp(mu + s * s / 2) * nd.cdf(z - s) / nd.cdf(z)
    r = mean * f / (1 - f)
    return r / (r + LONG_MARGIN * t)


def with_overrides(fitted: SynthSpec, given: Mapping[str, Any]) -> SynthSpec:
    """``fitted`` with the fields in ``given`` replaced; fitted fields that would now
    clash with given ones are moved (the given never): a busy-phase p90 or median keeps
    its fitted ratio to the other, ``max_context`` grows to twice the first prompt, and
    the short-time share is capped anew (:func:`short_time_cap`). Given values that
    clash among themselves are left for :meth:`SynthSpec.check` to refuse."""
    spec = replace(fitted, **given)
    ratio = fitted.busy_p90_s / fitted.busy_median_s
    if spec.busy_p90_s <= spec.busy_median_s:
        if "busy_p90_s" not in given:
            spec = replace(spec, busy_p90_s=spec.busy_median_s * ratio)
        elif "busy_median_s" not in given:
            spec = replace(spec, busy_median_s=spec.busy_p90_s / ratio)
    if "max_context" not in given and spec.max_context < 2 * spec.first_prompt_median:
        spec = replace(spec, max_context=2 * spec.first_prompt_median)
    return spec if "short_time_frac" in given else _capped(spec)


def describe(spec: SynthSpec, given: Collection[str] = (),
             fitted: Collection[str] = FITTED_FIELDS) -> str:
    """``spec`` one field a line, each marked ``given``, ``fitted`` or ``default``."""
    names = [f.name for f in fields(spec)]
    width = max(len(n) for n in names)
    lines = []
    for name in names:
        origin = "given" if name in given else "fitted" if name in fitted else "default"
        lines.append(f"  {name:<{width}}  {_fmt(getattr(spec, name)):>10}  {origin}")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return repr(value) if isinstance(value, str) else str(value)


def _capped(spec: SynthSpec) -> SynthSpec:
    """``spec`` with its short-time share at most :func:`short_time_cap` (which is in
    (0, 1), and may be under :data:`SHARE_BOUNDS`: few, brief short calls)."""
    return replace(spec, short_time_frac=min(spec.short_time_frac, short_time_cap(spec)))


def _label(source: TraceSet, provider: str | None) -> str:
    """The provider the generated programs carry: the one fitted to, else the set's only
    one; ``""`` for unknown or mixed."""
    if provider is not None:
        return "" if provider in ("", UNKNOWN_PROVIDER) else provider
    present = providers(source)
    return present[0] if len(present) == 1 and present[0] != UNKNOWN_PROVIDER else ""


def _share(value: float, default: float) -> float:
    return default if math.isnan(value) else _clamp(value, *SHARE_BOUNDS)


def _clamp(value: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, value))
