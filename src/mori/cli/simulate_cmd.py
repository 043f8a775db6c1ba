"""``mori simulate``: run the grid hardware x CPU ratio x programs x policy.

``--programs`` counts programs per replica, as in ``mori sweep`` (and the paper): with
``--replicas N`` a run simulates ``programs x N`` programs in all (``SimConfig.programs``).

Everything the user can get wrong is checked before the first run starts: names, values,
the trace set, and whether each grid point can be simulated at all (by building its
:class:`~mori.sim.runner.Simulation`). Such problems are :class:`UsageError`s, which
``main`` reports in one line with exit status 2.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mori.cli.options import BY_KEY, OPTIONS, OptionError, policy_config
from mori.cli.table import left_out_note, results_table
from mori.core.calibration import EngineCalibration
from mori.core.costmodel import get_preset
from mori.core.policies import POLICIES
from mori.core.registry import UnknownNameError
from mori.sim.config import SimConfig
from mori.sim.metrics import RunResult
from mori.sim.runner import SettingsError, Simulation, simulate
from mori.sweep.local import run_pool
from mori.traces import TraceError, TraceSet, default_traces, load_traces
from mori.traces.stats import empty_set_note


class UsageError(ValueError):
    """A problem with what the user asked for: one line on stderr, exit status 2."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The resolved options of one ``mori simulate`` invocation (see ``options.OPTIONS``)."""

    policy: tuple[str, ...]
    programs: tuple[int, ...]
    preset: tuple[str, ...]
    cpu_ratio: tuple[float, ...]
    replicas: int
    duration: float
    traces: Path | None
    seed: int
    json: Path | None
    plot: Path | None
    timeline: Path | None
    timeline_frames: int
    human_gap: str
    human_gap_cap: float
    max_context: int | None
    share_prefix: bool
    gpu_kv_tokens: int | None
    cpu_kv_tokens: int | None
    disk_ratio: tuple[float, ...]
    disk_kv_tokens: int | None
    disk: str
    token_scale: float
    engine_slowdown: float
    reload_gbps: float | None
    calibration: Path | None
    max_output_tokens: int | None
    tick: float
    idleness_window: int
    acting_token_weight: float
    acting_token_decay: bool
    recompute_tok_s: float | None
    max_wait: float | None
    load_window: float | None
    fill_idle: bool
    gpu_overcommit: float
    gpu_overcommit_max: float
    jobs: int
    quiet: bool


def resolve_settings(cli: dict[str, Any], config: dict[str, Any]) -> Settings:
    """Defaults, overridden by the config file, overridden by flags given (not None)."""
    values: dict[str, Any] = {o.key: o.default for o in OPTIONS}
    values.update(config)
    values.update({k: v for k, v in cli.items() if v is not None})
    return Settings(**values)


def build_grid(s: Settings) -> list[SimConfig]:
    """One :class:`SimConfig` per run, in grid order (policy varies fastest); each run's
    ``programs`` is ``--programs`` (per replica) x ``--replicas``."""
    for name in s.policy:
        POLICIES.get(name)  # UnknownNameError lists the valid names
    for name in s.preset:
        get_preset(name)
    try:  # PolicyConfig checks the knobs (--tick, --idleness-window); the error names the flag
        knobs = policy_config({o.key: getattr(s, o.key) for o in OPTIONS}, BY_KEY)
    except OptionError as e:
        raise UsageError(str(e)) from None
    if s.jobs < 0:
        raise UsageError(f"--jobs must be >= 1, or 0 for one per CPU (got {s.jobs})")
    if s.replicas < 1:
        raise UsageError(f"--replicas must be >= 1 (got {s.replicas})")
    for n in s.programs:
        if n < 1:
            raise UsageError(f"--programs must be >= 1 per replica (got {n})")
    calibration = read_calibration(s.calibration) if s.calibration is not None else None
    return [
        SimConfig(policy=pol, programs=n * s.replicas, hardware=hw, cpu_ratio=cpu,
                  replicas=s.replicas, duration_s=s.duration, seed=s.seed,
                  human_gap=s.human_gap, human_gap_cap_s=s.human_gap_cap,
                  max_context=s.max_context, share_prefix=s.share_prefix,
                  gpu_kv_tokens=s.gpu_kv_tokens, cpu_kv_tokens=s.cpu_kv_tokens,
                  token_scale=s.token_scale, engine_slowdown=s.engine_slowdown, reload_gbps=s.reload_gbps,
                  max_output_tokens=s.max_output_tokens, disk_ratio=disk,
                  disk_kv_tokens=s.disk_kv_tokens, disk=s.disk,
                  policy_config=knobs, calibration=calibration)
        for hw in s.preset for cpu in s.cpu_ratio for disk in s.disk_ratio
        for n in s.programs for pol in s.policy
    ]


def read_calibration(path: Path) -> EngineCalibration:
    """The engine calibration in ``path``: a calibration file (its ``constants``) or a
    benchmark's results holding one (``settings.calibration.constants``)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise UsageError(f"--calibration {str(path)!r}: cannot read it as JSON: {e}") from None
    try:
        return EngineCalibration.from_document(doc)
    except ValueError as e:
        raise UsageError(f"--calibration {str(path)!r}: {e}") from None


def _check_output(path: Path | None, option: str) -> None:
    if path is not None and not path.parent.is_dir():
        raise UsageError(f"{option} {str(path)!r}: folder {str(path.parent)!r} does not exist")


def prepare(s: Settings) -> tuple[list[SimConfig], TraceSet]:
    """The grid and the trace set, after checking every run can start (else UsageError)."""
    try:
        configs = build_grid(s)
        traces = load_traces(s.traces) if s.traces is not None else default_traces()
        if (empty := empty_set_note(traces)) is not None:
            raise UsageError(empty)
        for config in configs:
            Simulation(config, traces)  # raises SettingsError / ValueError; cheap to build
    except (UnknownNameError, TraceError, SettingsError, ValueError) as e:
        if isinstance(e, UsageError):
            raise
        raise UsageError(str(e)) from None
    _check_output(s.json, "--json")
    _check_output(s.plot, "--plot")
    _check_output(s.timeline, "--timeline")
    if s.timeline_frames < 2:
        raise UsageError(f"--timeline-frames must be >= 2 (got {s.timeline_frames})")
    return configs, traces


Outcome = tuple[RunResult, str | None]
"""A run's results and, when a timeline was asked for, its HTML."""


def run_one(config: SimConfig, traces: TraceSet, timeline_frames: int | None) -> Outcome:
    """One run; with ``timeline_frames``, recorded for a timeline file too."""
    if timeline_frames is None:
        return simulate(config, traces), None
    from mori.dashboard.timeline import record_timeline  # only when asked for

    return record_timeline(config, traces, timeline_frames)


def _progress(total: int, quiet: bool) -> tqdm[Any]:
    return tqdm(total=total, desc="simulating", unit="run", file=sys.stderr, disable=quiet,
                dynamic_ncols=True)


def run_grid(configs: list[SimConfig], traces: TraceSet, jobs: int, quiet: bool,
             timeline_frames: int | None = None) -> list[Outcome]:
    """Every run's outcome, in the order of ``configs``; ``jobs`` > 1 runs them in worker
    processes (``mori.sweep.local.run_pool``, the pool ``mori sweep`` runs on).

    A progress bar goes to stderr unless ``quiet``.
    """
    work = functools.partial(run_one, traces=traces, timeline_frames=timeline_frames)
    stream = run_pool(configs, work, jobs)  # the work starts now, before the bar's thread
    outcomes: list[Outcome | None] = [None] * len(configs)
    with closing(stream), _progress(len(configs), quiet) as bar:
        for i, outcome in stream:
            outcomes[i] = outcome
            c = configs[i]
            bar.set_postfix_str(f"{c.policy} n={c.programs_per_replica}", refresh=False)
            bar.update()
    assert all(o is not None for o in outcomes)
    return [o for o in outcomes if o is not None]


def timeline_paths(path: Path, configs: list[SimConfig]) -> list[Path]:
    """Where each run's timeline goes: ``path`` for one run; for several, the name gets
    what tells the runs apart (policy and programs always; preset and CPU ratio when
    the grid varies them)."""
    if len(configs) == 1:
        return [path]
    presets = len({c.hardware for c in configs}) > 1
    ratios = len({c.cpu_ratio for c in configs}) > 1
    disks = len({c.disk_ratio for c in configs}) > 1
    out = []
    for c in configs:
        tag = f"{c.policy}-{c.programs_per_replica}"
        if presets:
            tag += f"-{c.hardware}"
        if ratios:
            tag += f"-cpu{c.cpu_ratio:g}"
        if disks:
            tag += f"-disk{c.disk_ratio:g}"
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in tag)
        out.append(path.with_name(f"{path.stem}-{safe}{path.suffix or '.html'}"))
    return out


def write_json(results: list[RunResult], path: Path) -> None:
    """The runs' ``to_dict()`` as a JSON list (sorted keys, indent 2)."""
    rows = [r.to_dict() for r in results]  # to_dict() maps NaN / infinity to null
    path.write_text(json.dumps(rows, sort_keys=True, indent=2, allow_nan=False) + "\n",
                    encoding="utf-8")


def table_text(results: list[RunResult], replicas: int,
               reload_gbps: float | None = None) -> str:
    """The results table; its programs column counts programs per replica, like
    ``--programs``. A title line above it says so with more than one replica, and names
    a ``--reload-gbps`` other than the presets'."""
    table = results_table(results, per_replica=True)
    title = []
    if replicas > 1:
        title.append(f"DP={replicas} (programs column: per replica; x{replicas} in all)")
    if reload_gbps is not None:
        title.append(f"KV reloads at {reload_gbps:g} GB/s per GPU")
    return "\n".join([*title, table]) if title else table


def run_simulate(s: Settings) -> int:
    """Run the grid, print the table (stdout, nothing else), write the optional JSON and
    plot. Notes (programs left out, files written) go to stderr unless ``quiet``."""
    configs, traces = prepare(s)
    jobs = min(s.jobs or os.cpu_count() or 1, len(configs))
    frames = s.timeline_frames if s.timeline is not None else None
    try:
        outcomes = run_grid(configs, traces, jobs, s.quiet, frames)
    except SettingsError as e:
        raise UsageError(str(e)) from None
    results = [r for r, _ in outcomes]
    print(table_text(results, s.replicas, s.reload_gbps), flush=True)
    cuts = {r.max_context for r in results}  # trace tokens, the token scale applied
    cut = s.max_context or (cuts.pop() if len(cuts) == 1 else None)
    note = left_out_note(results, traces.name, len(traces.programs), cut)
    if note and not s.quiet:
        print(note, file=sys.stderr)
    written = []
    try:
        if s.json is not None:
            write_json(results, s.json)
            written.append(str(s.json))
        if s.plot is not None:
            from mori.cli.plot import plot_results  # matplotlib only when asked for

            plot_results(results, s.plot, per_replica=True)
            written.append(str(s.plot))
        if s.timeline is not None:
            for path, (_, html) in zip(timeline_paths(s.timeline, configs), outcomes,
                                       strict=True):
                assert html is not None
                path.write_text(html, encoding="utf-8")
                written.append(str(path))
    except OSError as e:
        print(f"mori simulate: error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    if written and not s.quiet:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return 0
