"""The paper's workload analysis (docs/system.md, "The workload: busy and idle phases") of a trace set: pure functions.

Definitions (for a program; subagents are programs of their own, analysed as a separate
population; their whole life is one long tool call of their parent):

* A step's *wait* is what the program waited after its response: its gap, plus, when it
  spawned subagents, the longest ``delay_s`` + subagent span (a span is the sum of a
  program's call times and waits).
* *Tool calls* are the waits after ``TOOL`` and ``SUBAGENT`` steps; ``HUMAN`` waits (a
  person reading and typing) are counted apart, ``END`` steps have none.
* *Short* means a wait under the threshold (default 2 s). The short share of calls is
  their count over all tool calls; their share of tool time their summed wait over all
  tool calls' summed wait.
* A *busy phase* is a maximal run of steps whose waits between them are all short (of
  any kind): it lasts from its first request to its last response end (the sum of its
  call times and the short waits inside). Every run counts, a lone call included.
  A step without a recorded ``call_s`` counts its call time as 0 (the report counts
  such steps).
* *Idle fraction* of a program: tool-call time over tool-call time + call time (human
  waits excluded); ``idle_fraction_with_human`` counts human waits as idle too.
* *Context*: a program's first prompt, its peak prompt, and its growth per call up to
  the peak, ``(peak - first) / (calls from the first to the peak)``.

*Providers*: a program's provider is the agent that recorded it (``claude``, ``codex``;
``unknown`` when not recorded); subagents count with their top-level program. A set of
more than one provider is also analysed per provider (:func:`analyze_by_provider`),
each provider's programs alone, as :func:`analyze` would on a set of only them.

Percentiles interpolate linearly between order statistics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from mori.traces.model import GapKind, ProgramTrace, Step, TraceSet

DEFAULT_THRESHOLD_S = 2.0
UNKNOWN_PROVIDER = "unknown"
PHASE_THRESHOLDS_S = (1.0, 2.0, 5.0)

PAPER = {
    "programs": 532,
    "threshold_s": 2.0,
    "short_calls_frac": 0.87,
    "short_time_frac": 0.42,
    "busy_phase_s": {1.0: (4.0, None), 2.0: (20.0, 81.0), 5.0: (41.0, None)},
}
"""The paper's figures (532 Claude Code programs): at 2 s, 87 % of tool calls are short
and hold 42 % of tool time; busy phases last a median ~20 s (p90 ~81 s); the ~4 s and
~41 s it quotes "at other thresholds" are read here as the medians at 1 s and 5 s."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between order statistics; NaN if
    empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Dist:
    """Summary of a sample: count, median, p90, mean, total (NaN when empty)."""

    n: int
    median: float
    p90: float
    mean: float
    total: float

    @staticmethod
    def of(values: Sequence[float]) -> Dist:
        if not values:
            return Dist(0, math.nan, math.nan, math.nan, 0.0)
        total = math.fsum(values)
        return Dist(len(values), percentile(values, 0.5), percentile(values, 0.9),
                    total / len(values), total)


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """Busy-phase durations at one threshold."""

    threshold_s: float
    durations: Dist


@dataclass(frozen=True, slots=True)
class PopulationStats:
    """The analysis of one population of programs (top-level, or subagents)."""

    programs: int
    llm_calls: Dist
    tool_gaps: Dist
    short_calls_frac: float
    short_time_frac: float
    human_gaps: Dist
    busy_phases: tuple[PhaseStats, ...]
    idle_fraction: Dist
    idle_fraction_with_human: Dist
    first_prompt: Dist
    peak_prompt: Dist
    growth_per_call: Dist
    steps_without_call_time: int


@dataclass(frozen=True, slots=True)
class TraceStats:
    """The analysis of a trace set: top-level programs and subagents apart; ``providers``
    the providers of its programs (:func:`providers`)."""

    name: str
    threshold_s: float
    main: PopulationStats
    subagents: PopulationStats | None
    providers: tuple[str, ...] = ()
    gaps_main: tuple[float, ...] = field(repr=False, default=())
    gaps_subagents: tuple[float, ...] = field(repr=False, default=())


def empty_set_note(ts: TraceSet) -> str | None:
    """What to tell of a trace set that holds no program (None: it holds some). A set
    recorded by ``mori serve --record`` is empty when none of its clients' requests was
    recognised as a program (anonymous requests are not recorded)."""
    if ts.programs:
        return None
    return (f"trace set {ts.name!r} holds no program; a recording (mori serve --record) "
            "is empty when the gateway recognised none of its clients' requests as a "
            "program (anonymous requests are not recorded): name the program "
            "(program_id, X-Program-Id, X-Session-Id) or check --program-id-from")


def provider_of(program: ProgramTrace) -> str:
    """The program's provider, ``unknown`` when not recorded."""
    return program.provider or UNKNOWN_PROVIDER


def providers(ts: TraceSet) -> tuple[str, ...]:
    """The providers of the set's top-level programs, sorted, ``unknown`` last."""
    return tuple(sorted({provider_of(p) for p in ts.programs},
                        key=lambda name: (name == UNKNOWN_PROVIDER, name)))


def select_provider(ts: TraceSet, provider: str) -> TraceSet:
    """The set's top-level programs of ``provider`` (``unknown`` or ``""``: those without
    one), their subagents along; ``ValueError`` naming the providers present if none."""
    wanted = provider or UNKNOWN_PROVIDER
    programs = tuple(p for p in ts.programs if provider_of(p) == wanted)
    if not programs:
        present = ", ".join(providers(ts)) or "none (the set is empty)"
        raise ValueError(f"no program of provider {wanted!r} in trace set {ts.name!r}; "
                         f"its providers: {present}")
    return TraceSet(ts.name, programs)


def span_s(program: ProgramTrace) -> float:
    """A program's duration: the sum of its call times (0 when unknown) and waits."""
    return math.fsum((s.call_s or 0.0) + wait_s(s) for s in program.steps)


def wait_s(step: Step) -> float:
    """What the program waited after ``step`` (0 for the last step without subagents)."""
    if not step.subagents:
        return step.gap_s
    return max(sp.delay_s + span_s(sp.program) for sp in step.subagents) + step.gap_s


def tool_waits(program: ProgramTrace) -> list[float]:
    """The waits of a program's tool calls (``TOOL`` and ``SUBAGENT`` steps)."""
    return [wait_s(s) for s in program.steps
            if s.gap_kind in (GapKind.TOOL, GapKind.SUBAGENT)]


def human_waits(program: ProgramTrace) -> list[float]:
    """The waits of a program's ``HUMAN`` steps."""
    return [wait_s(s) for s in program.steps if s.gap_kind is GapKind.HUMAN]


def busy_phases(program: ProgramTrace, threshold_s: float) -> list[float]:
    """Durations of the program's busy phases at ``threshold_s`` (module doc)."""
    if not program.steps:
        return []
    phases: list[float] = []
    current = 0.0
    last = len(program.steps) - 1
    for index, step in enumerate(program.steps):
        current += step.call_s or 0.0
        wait = wait_s(step)
        if index == last:
            break
        if wait < threshold_s:
            current += wait
        else:
            phases.append(current)
            current = 0.0
    phases.append(current)
    return phases


def idle_fractions(program: ProgramTrace) -> tuple[float, float] | None:
    """(idle fraction without, with human waits); ``None`` for a program without any
    call or tool time."""
    calls = math.fsum(s.call_s or 0.0 for s in program.steps)
    tools = math.fsum(tool_waits(program))
    human = math.fsum(human_waits(program))
    without = tools / (tools + calls) if tools + calls > 0 else math.nan
    with_h = (tools + human) / (tools + human + calls) if tools + human + calls > 0 else math.nan
    if math.isnan(without):
        return None
    return without, with_h


def context_growth(program: ProgramTrace) -> tuple[int, int, float | None]:
    """(first prompt, peak prompt, growth per call up to the peak or ``None``)."""
    prompts = [s.prompt_tokens for s in program.steps]
    if not prompts:
        return 0, 0, None
    peak_index = max(range(len(prompts)), key=lambda i: (prompts[i], -i))
    growth = (prompts[peak_index] - prompts[0]) / peak_index if peak_index > 0 else None
    return prompts[0], prompts[peak_index], growth


def population(programs: Sequence[ProgramTrace], threshold_s: float,
               phase_thresholds: Iterable[float]) -> tuple[PopulationStats, list[float]]:
    """The analysis of ``programs`` (each alone: subagents below them are not included),
    and the tool-call waits it was computed from."""
    gaps = [g for p in programs for g in tool_waits(p)]
    humans = [g for p in programs for g in human_waits(p)]
    short = [g for g in gaps if g < threshold_s]
    total = math.fsum(gaps)
    thresholds = sorted(set(phase_thresholds) | {threshold_s})
    phases = tuple(
        PhaseStats(t, Dist.of([d for p in programs for d in busy_phases(p, t)]))
        for t in thresholds
    )
    idle = [f for p in programs if (f := idle_fractions(p)) is not None]
    growth = [context_growth(p) for p in programs if p.steps]
    stats = PopulationStats(
        programs=len(programs),
        llm_calls=Dist.of([float(len(p.steps)) for p in programs]),
        tool_gaps=Dist.of(gaps),
        short_calls_frac=len(short) / len(gaps) if gaps else math.nan,
        short_time_frac=math.fsum(short) / total if total > 0 else math.nan,
        human_gaps=Dist.of(humans),
        busy_phases=phases,
        idle_fraction=Dist.of([f[0] for f in idle]),
        idle_fraction_with_human=Dist.of([f[1] for f in idle]),
        first_prompt=Dist.of([float(g[0]) for g in growth]),
        peak_prompt=Dist.of([float(g[1]) for g in growth]),
        growth_per_call=Dist.of([g[2] for g in growth if g[2] is not None]),
        steps_without_call_time=sum(1 for p in programs for s in p.steps if s.call_s is None),
    )
    return stats, gaps


def analyze(ts: TraceSet, threshold_s: float = DEFAULT_THRESHOLD_S,
            phase_thresholds: Iterable[float] = PHASE_THRESHOLDS_S) -> TraceStats:
    """The analysis of a trace set: its top-level programs, and its subagents apart."""
    if not threshold_s > 0:
        raise ValueError(f"threshold must be positive, got {threshold_s}")
    thresholds = tuple(phase_thresholds)
    main, gaps_main = population(ts.programs, threshold_s, thresholds)
    subs = [q for p in ts.programs for q in p.all_programs()[1:]]
    sub_stats, gaps_sub = population(subs, threshold_s, thresholds) if subs else (None, [])
    return TraceStats(ts.name, threshold_s, main, sub_stats, providers(ts), tuple(gaps_main),
                      tuple(gaps_sub))


def analyze_by_provider(ts: TraceSet, threshold_s: float = DEFAULT_THRESHOLD_S,
                        phase_thresholds: Iterable[float] = PHASE_THRESHOLDS_S
                        ) -> dict[str, TraceStats]:
    """:func:`analyze` of each provider's programs alone, by provider (in the order of
    :func:`providers`); one entry for a set of one provider."""
    thresholds = tuple(phase_thresholds)
    return {name: analyze(select_provider(ts, name), threshold_s, thresholds)
            for name in providers(ts)}


def _clean(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _pop_json(p: PopulationStats | None) -> object:
    return None if p is None else _clean(asdict(p))


def to_json(stats: TraceStats, by_provider: Mapping[str, TraceStats] | None = None
            ) -> dict[str, object]:
    """``stats`` as a JSON-able dict (NaN as ``null``), with the paper's figures; when
    ``by_provider`` (:func:`analyze_by_provider`) holds more than one provider, also
    ``"by_provider": {provider: {"main": ..., "subagents": ...}}``."""
    paper = dict(PAPER)
    paper["busy_phase_s"] = {f"{t:g}": {"median": m, "p90": p90}
                             for t, (m, p90) in PAPER["busy_phase_s"].items()}  # type: ignore[attr-defined]
    out: dict[str, object] = {
        "name": stats.name,
        "threshold_s": stats.threshold_s,
        "providers": list(stats.providers),
        "main": _pop_json(stats.main),
        "subagents": _pop_json(stats.subagents),
        "paper": paper,
    }
    if by_provider is not None and len(by_provider) > 1:
        out["by_provider"] = {
            name: {"main": _pop_json(s.main), "subagents": _pop_json(s.subagents)}
            for name, s in by_provider.items()}
    return out


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f} %"


def _num(x: float, digits: int = 1) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:,.{digits}f}"


def _pair(d: Dist, digits: int = 1) -> str:
    return f"{_num(d.median, digits)} / {_num(d.p90, digits)}"


def _rows(p: PopulationStats, threshold_s: float, paper: bool,
          missing_row: bool) -> list[tuple[str, str, str]]:
    t = f"{threshold_s:g} s"
    paper_on = paper and threshold_s == PAPER["threshold_s"]
    phase_paper: dict[float, tuple[float, float | None]] = PAPER["busy_phase_s"]  # type: ignore[assignment]
    rows = [
        ("programs", f"{p.programs:,}", "532" if paper else ""),
        ("LLM calls per program: median / p90", _pair(p.llm_calls), ""),
        ("LLM calls in all", f"{p.llm_calls.total:,.0f}", ""),
        ("tool calls (incl. subagent waits)", f"{p.tool_gaps.n:,}", ""),
        ("tool call s: median / p90", _pair(p.tool_gaps, 2), ""),
        (f"calls under {t}: share of calls", _pct(p.short_calls_frac),
         "87 %" if paper_on else ""),
        (f"calls under {t}: share of tool time", _pct(p.short_time_frac),
         "42 %" if paper_on else ""),
    ]
    for ph in p.busy_phases:
        m, p90 = phase_paper.get(ph.threshold_s, (math.nan, None)) if paper else (math.nan, None)
        ref = "" if math.isnan(m) else f"~{m:g}" + (f" / ~{p90:g}" if p90 is not None else " / -")
        rows.append((f"busy phase at {ph.threshold_s:g} s: median / p90 s (n)",
                     f"{_pair(ph.durations)} ({ph.durations.n:,})", ref))
    rows += [
        ("idle fraction per program: median / p90", _pair(p.idle_fraction, 2), ""),
        ("  with human time: median / p90", _pair(p.idle_fraction_with_human, 2), ""),
        ("human gaps: count, median s", f"{p.human_gaps.n:,}, {_num(p.human_gaps.median)}", ""),
        ("first prompt tokens: median / p90", _pair(p.first_prompt, 0), ""),
        ("peak prompt tokens: median / p90", _pair(p.peak_prompt, 0), ""),
        ("context growth per call (tokens): median / p90", _pair(p.growth_per_call, 0), ""),
    ]
    if missing_row:
        rows.append(("steps without a recorded call time (counted 0 s)",
                     f"{p.steps_without_call_time:,}", ""))
    return rows


def _empty_like(p: PopulationStats, threshold_s: float) -> PopulationStats:
    """A population of no program, with ``p``'s phase thresholds (a provider whose
    programs spawned no subagent)."""
    return population([], threshold_s, [ph.threshold_s for ph in p.busy_phases])[0]


def _table(title: str, columns: Sequence[tuple[str, PopulationStats]], threshold_s: float,
           paper: bool) -> list[str]:
    """One section: a label column, one value column per population, the paper's."""
    missing = any(pop.steps_without_call_time for _, pop in columns)
    rows = [_rows(pop, threshold_s, paper, missing) for _, pop in columns]
    labels = [r[0] for r in rows[0]]
    refs = [r[2] for r in rows[0]]
    width = max(len(label) for label in labels)
    widths = [max(len(head), *(len(r[1]) for r in col))
              for (head, _), col in zip(columns, rows, strict=True)]
    header = f"{title:<{width}}" + "".join(
        f"  {head:>{w}}" for (head, _), w in zip(columns, widths, strict=True))
    lines = ["", header + ("  paper" if paper else "")]
    for i, label in enumerate(labels):
        values = "".join(f"  {col[i][1]:>{w}}" for col, w in zip(rows, widths, strict=True))
        lines.append(f"{label:<{width}}{values}  {refs[i]}".rstrip())
    return lines


def _header(stats: TraceStats) -> str:
    line = f"trace set {stats.name!r}, threshold {stats.threshold_s:g} s"
    if len(stats.providers) > 1:
        return line + f", providers {', '.join(stats.providers)}"
    if stats.providers and stats.providers[0] != UNKNOWN_PROVIDER:
        return line + f", provider {stats.providers[0]}"
    return line


def format_stats(stats: TraceStats, paper: bool = True,
                 by_provider: Mapping[str, TraceStats] | None = None) -> str:
    """A plain-text report, the paper's figures beside ours (``paper``). When
    ``by_provider`` (:func:`analyze_by_provider`) holds more than one provider, each gets
    a column beside the whole set's (``all``)."""
    split = dict(by_provider) if by_provider is not None and len(by_provider) > 1 else {}
    t = stats.threshold_s
    main_cols = [("all" if split else "this set", stats.main)]
    main_cols += [(name, s.main) for name, s in split.items()]
    lines = [_header(stats)]
    lines += _table("top-level programs", main_cols, t, paper)
    if stats.subagents is not None:
        empty = _empty_like(stats.subagents, t)
        sub_cols = [("all" if split else "this set", stats.subagents)]
        sub_cols += [(name, s.subagents or empty) for name, s in split.items()]
        lines += _table("subagents (each a program of its own)", sub_cols, t, False)
    return "\n".join(lines)
