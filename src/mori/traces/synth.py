"""A generator of agent programs with given workload statistics.

:func:`synthesize` builds programs that alternate *busy phases* (runs of LLM calls
separated by short tool calls, under the threshold) and *long tool calls* (at or over it),
so that :func:`mori.traces.stats.analyze` at the same threshold reports what the
:class:`SynthSpec` asks (defaults: the paper's figures):

* the share of tool calls under the threshold, and the share of tool time they hold;
* the busy-phase durations' median and p90;
* contexts like the real traces: a first prompt around ``first_prompt_median`` tokens,
  growing by ``growth_per_call`` tokens a call on average (output plus tool result),
  compacted back near the first prompt if it would pass ``max_context``.

How: every phase's duration is drawn from a log-normal with the asked median and p90,
stratified over all phases (the i-th smallest of n is its ``i/(n-1)`` quantile, clipped
to ``[0.5/n, 1 - 0.5/n]``), so the sample's quantiles are the asked ones. The number
of short calls is set from the number of long ones (one between consecutive phases) to
give the asked share exactly, and spread over phases in proportion to their duration;
inside a phase, short gaps come from a log-normal truncated under the threshold and the
rest of the phase is split between its calls. Last, long gaps are ``threshold + x``
with ``x`` log-normal, all ``x`` scaled by one factor so that the short calls hold the
asked share of tool time. All randomness comes from one ``random.Random(seed)``: the same
spec and seed give the same programs.

Tolerance (checked by the tests over several seeds, at 20 programs or more): the two
shares within 1 percentage point, the busy-phase median and p90 within 5 %, the median
first prompt and growth per call within 15 %.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

from mori.traces.model import GapKind, ProgramTrace, Step, TraceSet

_Z = NormalDist()
SHORT_TOOLS = ("Read", "Grep", "Glob", "Edit")
LONG_TOOLS = ("Bash", "Bash", "WebFetch", "Task")


@dataclass(frozen=True, slots=True)
class SynthSpec:
    """What to generate. Times in seconds, sizes in tokens; ``provider`` labels the
    programs (``ProgramTrace.provider``, ``""`` for none)."""

    programs: int = 50
    seed: int = 0
    threshold_s: float = 2.0
    short_calls_frac: float = 0.87
    short_time_frac: float = 0.42
    busy_median_s: float = 20.0
    busy_p90_s: float = 81.0
    phases_median: float = 6.0
    phases_sigma: float = 0.6
    short_gap_median_s: float = 0.4
    short_gap_sigma: float = 1.0
    long_gap_sigma: float = 1.6
    first_prompt_median: int = 20_000
    first_prompt_sigma: float = 0.3
    growth_per_call: float = 1_000.0
    growth_sigma: float = 0.9
    output_median: int = 200
    max_context: int = 200_000
    name: str = ""
    provider: str = ""

    def check(self) -> None:
        """Raise ``ValueError`` naming the first impossible setting."""
        if self.programs < 1:
            raise ValueError(f"programs must be at least 1, got {self.programs}")
        for key in ("threshold_s", "busy_median_s", "phases_median", "short_gap_median_s",
                    "growth_per_call", "first_prompt_median", "output_median", "max_context"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be positive, got {value}")
        for key in ("short_calls_frac", "short_time_frac"):
            value = getattr(self, key)
            if not 0 < value < 1:
                raise ValueError(f"{key} must be strictly between 0 and 1, got {value}")
        if not self.busy_p90_s > self.busy_median_s:
            raise ValueError(f"busy_p90_s ({self.busy_p90_s}) must exceed busy_median_s "
                             f"({self.busy_median_s})")
        if self.first_prompt_median * 2 > self.max_context:
            raise ValueError("max_context must be at least twice first_prompt_median")


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(sigma * rng.gauss(0.0, 1.0))


def _truncated_lognormal(rng: random.Random, median: float, sigma: float, upper: float) -> float:
    """A log-normal draw conditioned on being under ``upper`` (by inverse CDF)."""
    top = _Z.cdf(math.log(upper / median) / sigma)
    u = rng.uniform(1e-9, top * (1 - 1e-9))
    return min(median * math.exp(sigma * _Z.inv_cdf(u)), upper * (1 - 1e-9))


def _phase_durations(rng: random.Random, n: int, median: float, p90: float) -> list[float]:
    sigma = math.log(p90 / median) / _Z.inv_cdf(0.9)
    lo, hi = 0.5 / n, 1 - 0.5 / n
    values = [median * math.exp(sigma * _Z.inv_cdf(min(hi, max(lo, i / max(1, n - 1)))))
              for i in range(n)]
    rng.shuffle(values)
    return values


@dataclass(slots=True)
class _Cycle:
    call_s: float
    gap_s: float  # short gap, or the long gap's excess over the threshold (scaled later)
    long: bool
    end: bool


def synthesize(spec: SynthSpec) -> TraceSet:
    """Generate ``spec.programs`` programs (rules and tolerance: module doc)."""
    spec.check()
    rng = random.Random(spec.seed)
    t = spec.threshold_s
    phase_counts = [max(1, round(_lognormal(rng, spec.phases_median, spec.phases_sigma)))
                    for _ in range(spec.programs)]
    n_phases = sum(phase_counts)
    durations = _phase_durations(rng, n_phases, spec.busy_median_s, spec.busy_p90_s)
    n_long = n_phases - spec.programs
    n_short = round(n_long * spec.short_calls_frac / (1 - spec.short_calls_frac))
    if n_long == 0:
        n_short = 0
    shorts = [0] * n_phases
    for index in rng.choices(range(n_phases), weights=durations, k=n_short):
        shorts[index] += 1
    cycles: list[list[_Cycle]] = []
    phase = 0
    for count in phase_counts:
        program: list[_Cycle] = []
        for j in range(count):
            program.extend(_phase(rng, spec, durations[phase], shorts[phase],
                                  last=j == count - 1))
            phase += 1
        cycles.append(program)
    short_total = math.fsum(c.gap_s for p in cycles for c in p if not c.long and not c.end)
    excess = math.fsum(c.gap_s for p in cycles for c in p if c.long)
    if n_long:
        target_long = short_total * (1 - spec.short_time_frac) / spec.short_time_frac
        room = target_long - n_long * t
        if room <= 0:
            raise ValueError(
                f"infeasible: with {spec.short_calls_frac:.0%} of calls under {t:g} s holding "
                f"{spec.short_time_frac:.0%} of tool time, long calls would average under "
                f"the threshold; raise short_gap_median_s or lower short_time_frac")
        scale = room / excess
        for p in cycles:
            for c in p:
                if c.long:
                    c.gap_s = t + c.gap_s * scale
    programs = tuple(_program(rng, spec, i, p) for i, p in enumerate(cycles))
    return TraceSet(name=spec.name or f"synth-{spec.programs}-seed{spec.seed}",
                    programs=programs)


def _phase(rng: random.Random, spec: SynthSpec, duration: float, n_short: int,
           last: bool) -> list[_Cycle]:
    calls = n_short + 1
    gaps = [_truncated_lognormal(rng, spec.short_gap_median_s, spec.short_gap_sigma,
                                 spec.threshold_s) for _ in range(n_short)]
    c_min = min(0.5, duration / (2 * calls))
    room = duration - calls * c_min
    if gaps and math.fsum(gaps) > 0.5 * room:
        factor = 0.5 * room / math.fsum(gaps)
        gaps = [g * factor for g in gaps]
    rest = duration - calls * c_min - math.fsum(gaps)
    weights = [rng.gammavariate(2.0, 1.0) for _ in range(calls)]
    wsum = math.fsum(weights)
    out: list[_Cycle] = []
    for k in range(calls):
        call_s = c_min + rest * weights[k] / wsum
        if k < calls - 1:
            out.append(_Cycle(call_s, gaps[k], long=False, end=False))
        elif last:
            out.append(_Cycle(call_s, 0.0, long=False, end=True))
        else:
            out.append(_Cycle(call_s, _lognormal(rng, 1.0, spec.long_gap_sigma), long=True,
                              end=False))
    return out


def _program(rng: random.Random, spec: SynthSpec, index: int, cycles: list[_Cycle]
             ) -> ProgramTrace:
    first = max(1000, round(_lognormal(rng, spec.first_prompt_median, spec.first_prompt_sigma)))
    first = min(first, spec.max_context // 2)
    shared = round(first * 0.7)
    mu_growth = math.log(spec.growth_per_call) - spec.growth_sigma ** 2 / 2
    prompt = first
    reuse = 0  # the first call reuses nothing
    steps: list[Step] = []
    for c in cycles:
        growth = max(1, round(math.exp(mu_growth + spec.growth_sigma * rng.gauss(0.0, 1.0))))
        output = max(1, min(growth, round(_lognormal(rng, spec.output_median, 1.0))))
        kind = GapKind.END if c.end else GapKind.TOOL
        tools: tuple[str, ...] = ()
        if not c.end:
            tools = (rng.choice(LONG_TOOLS if c.long else SHORT_TOOLS),)
        steps.append(Step(
            prompt_tokens=prompt, output_tokens=output, gap_s=c.gap_s, gap_kind=kind,
            reuse_tokens=reuse, new_tokens=prompt - reuse, call_s=c.call_s,
            tool_names=tools))
        reuse = prompt  # the next prompt extends this one
        prompt += growth
        if prompt + spec.output_median * 4 > spec.max_context:  # compaction
            prompt = round(first * 1.1)
            reuse = shared  # only the tools + system prefix survives it
    return ProgramTrace(name=f"synth-{spec.seed}-{index:04d}", steps=tuple(steps),
                        shared_prefix_tokens=shared, source="mori trace synth",
                        provider=spec.provider)
