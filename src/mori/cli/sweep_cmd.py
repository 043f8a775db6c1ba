"""``mori sweep``: run a named or custom grid of simulations, resumable, locally or on Ray.

Outputs in ``--out DIR``: ``<preset>_cpu<R>_dp<N>.json`` and ``.png`` per setting,
``<preset>_cpu<R>_scaling.png`` where a preset and CPU ratio were run on several replica
counts (against the replicas), ``sweep.json`` with every run, and ``runs/<key>.json``, one record per finished run,
which a rerun of the same sweep reuses (``--fresh`` ignores them). Everything the user
can get wrong is checked before the first run; such problems exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path
from typing import Any

from mori.cli.options import BY_KEY, POLICY_FIELDS, Option, add_options, help_text, policy_config
from mori.cli.simulate_cmd import UsageError
from mori.cli.table import format_table, left_out_note, results_table
from mori.core.registry import UnknownNameError
from mori.sim.config import SimConfig
from mori.sim.metrics import RunResult
from mori.sim.runner import SettingsError
from mori.sweep import ray_exec
from mori.sweep.grid import SWEEPS, Block, Run, SweepDef, expand, settings_of
from mori.sweep.local import Executor, run_local
from mori.sweep.run import execute, partition, validate
from mori.sweep.store import RunStore, result_row, write_setting, write_sweep
from mori.traces import TraceError, default_traces, load_traces

GRID_KEYS = ("policy", "programs", "preset", "cpu_ratio", "disk_ratio", "replicas")
"""Options that define a custom grid (not allowed with a named sweep)."""
SHARED_KEYS = ("duration", "seed", "human_gap", "human_gap_cap", "max_context",
               "share_prefix", "tick", "idleness_window", "disk", "gpu_overcommit",
               "gpu_overcommit_max")
"""The options every run of a sweep shares (SimConfig fields and policy knobs)."""

SWEEP_OPTIONS: tuple[Option, ...] = tuple(dataclasses.replace(o, help=o.help.replace(
    " (see below)", "")) for o in (
    BY_KEY["policy"], BY_KEY["programs"], BY_KEY["preset"], BY_KEY["cpu_ratio"],
    BY_KEY["disk_ratio"], dataclasses.replace(BY_KEY["replicas"], multi=True, default=(1,), metavar="N,...",
                        help="engine replica counts (DP), one setting each"),
    *(BY_KEY[k] for k in SHARED_KEYS), BY_KEY["traces"], BY_KEY["quiet"],
))
"""The grid and simulation options of ``mori sweep``, from ``mori simulate``'s."""

EPILOG = """\
A named sweep (see --list) takes the simulation options (--duration, --seed, --traces,
--human-gap, ...) as overrides; without NAME the grid options define a custom sweep
(defaults as in `mori simulate`). Resume is the default: runs with a matching record in
DIR/runs are skipped. --programs is per replica. With --ray and no --ray-address a local
Ray instance is started (--jobs CPUs); on a cluster `mori` must be installed on the
workers.

examples:
  mori sweep --list
  mori sweep paper --out out/paper --jobs 8
  mori sweep paper --out out/paper --ray --ray-address auto
  mori sweep --out out/dp --preset h200-qwen3-30b-a3b --replicas 1,2,4 --programs 20,50
"""


def add_sweep_parser(sub: Any) -> None:
    """Register ``sweep`` on the ``mori`` subcommand action ``sub``."""
    p = sub.add_parser(
        "sweep", help="run a resumable grid of simulations (locally or on Ray)",
        description="Run a named or custom grid of simulations; write one JSON and one "
        "figure per (preset, cpu ratio, replicas) setting and sweep.json.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", metavar="NAME", help="a named sweep (see --list)")
    p.add_argument("--list", action="store_true", help="list the named sweeps and exit")
    p.add_argument("--out", type=Path, metavar="DIR", help="output folder (required)")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="parallel runs (default: one per CPU; with --ray, Ray's choice)")
    p.add_argument("--ray", action="store_true",
                   help=f"run on Ray (needs: {ray_exec.INSTALL_HINT})")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="join this Ray cluster (auto, ray://host:10001); implies --ray")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--only-missing", action="store_true",
                      help="resume: run only the runs without a record (the default)")
    mode.add_argument("--fresh", action="store_true",
                      help="ignore existing run records and overwrite them")
    add_options(p, SWEEP_OPTIONS, help_text)


def list_sweeps() -> str:
    """The named sweeps: name, runs, settings, description."""
    defs = [SWEEPS.get(n) for n in SWEEPS.names()]
    rows = [(d.name or "", str(d.size()), str(len(settings_of(expand(d)))), d.description)
            for d in defs]
    return format_table(("sweep", "runs", "settings", "description"), rows,
                        (False, True, True, False))


def build_sweep(args: argparse.Namespace) -> SweepDef:
    """The sweep asked for: a named one with overrides, or a custom grid from the flags."""
    given = {o.key: getattr(args, o.key) for o in SWEEP_OPTIONS
             if getattr(args, o.key) is not None}
    shared = {k: v for k, v in given.items() if k in SHARED_KEYS}
    traces: Path | None = given.get("traces")
    if args.name is not None:
        try:
            named = SWEEPS.get(args.name)
        except UnknownNameError as e:
            raise UsageError(str(e)) from None
        grid = [BY_KEY[k].flag for k in GRID_KEYS if k in given]
        if grid:
            raise UsageError(f"{', '.join(grid)} define a custom sweep; give them without "
                             f"NAME (sweep {args.name!r} has its own grid)")
        return dataclasses.replace(named, base=with_shared(named.base, shared),
                                   traces=traces if traces is not None else named.traces)
    v = {o.key: given.get(o.key, o.default) for o in SWEEP_OPTIONS}
    block = Block(v["preset"], v["cpu_ratio"], v["replicas"], v["programs"], v["policy"],
                  disk_ratio=v["disk_ratio"])
    base = with_shared(SimConfig(), {k: v[k] for k in SHARED_KEYS})
    return SweepDef(None, "custom sweep", (block,), base, traces)


def with_shared(base: SimConfig, values: dict[str, Any]) -> SimConfig:
    """``base`` with shared options set (option key -> value): SimConfig fields directly,
    policy knobs in its ``policy_config``. A bad value raises ``ValueError``."""
    knobs = policy_config(values, BY_KEY, base.policy_config)
    sim = {BY_KEY[k].target: v for k, v in values.items() if BY_KEY[k].target not in POLICY_FIELDS}
    return dataclasses.replace(base, policy_config=knobs, **sim)


def _executor(args: argparse.Namespace) -> tuple[Executor, str]:
    if args.ray or args.ray_address:
        run = functools.partial(ray_exec.run_ray, jobs=args.jobs or None,
                                address=args.ray_address)
        return run, f"Ray at {args.ray_address}" if args.ray_address else "local Ray"
    jobs = args.jobs or os.cpu_count() or 1
    return functools.partial(run_local, jobs=jobs), f"{jobs} local processes"


def write_outputs(out: Path, sweep: SweepDef, runs: list[Run], results: list[RunResult],
                  store: RunStore) -> list[Path]:
    """The per-setting JSON and PNG files and sweep.json; returns the paths written."""
    from mori.cli.plot import plot_results, plot_scaling, scaling_groups  # matplotlib

    written, settings = [], []
    for setting in settings_of(runs):
        pairs = [(run, r) for run, r in zip(runs, results, strict=True)
                 if run.setting == setting]
        written.append(write_setting(out, setting.stem, [result_row(a, r) for a, r in pairs]))
        png = out / f"{setting.stem}.png"
        plot_results([r for _, r in pairs], png, per_replica=True)
        written.append(png)
        entry: dict[str, object] = {"hardware": setting.hardware,
                                    "cpu_ratio": setting.cpu_ratio,
                                    "replicas": setting.replicas}
        if setting.disk_ratio:
            entry["disk_ratio"] = setting.disk_ratio
        settings.append({**entry, "json": f"{setting.stem}.json", "png": png.name})
    scaling = []  # settings run on several replica counts: how they scale
    for (hw, cpu), group in scaling_groups(results).items():
        png = out / f"{hw}_cpu{cpu:g}_scaling.png"
        plot_scaling(group, png)
        written.append(png)
        scaling.append({"hardware": hw, "cpu_ratio": cpu, "png": png.name})
    meta = {"sweep": sweep.name, "description": sweep.description, "settings": settings,
            "scaling": scaling,
            "traces": {"name": store.traces_name, "sha256": store.digest}}
    rows = [result_row(a, r) for a, r in zip(runs, results, strict=True)]
    written.append(write_sweep(out, meta, rows))
    return written


def summary(runs: list[Run], results: list[RunResult]) -> str:
    """One titled results table per setting."""
    parts = []
    for setting in settings_of(runs):
        here = [r for a, r in zip(runs, results, strict=True) if a.setting == setting]
        title = f"{setting.hardware}, cpu ratio {setting.cpu_ratio:g}, DP={setting.replicas}"
        if setting.disk_ratio:
            title += f", disk ratio {setting.disk_ratio:g}"
        if setting.replicas > 1:
            title += " (programs column: per replica)"
        parts.append(f"{title}\n{results_table(here, per_replica=True)}")
    return "\n\n".join(parts)


def _run(args: argparse.Namespace) -> int:
    if args.list:
        print(list_sweeps())
        return 0
    if args.ray or args.ray_address:
        ray_exec.import_ray()  # fail now, clearly, if Ray is missing
    if args.out is None:
        raise UsageError("--out DIR is required (results and run records go there)")
    if args.jobs is not None and args.jobs < 0:
        raise UsageError(f"--jobs must be >= 1, or 0 for one per CPU (got {args.jobs})")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {str(args.out)!r} exists and is not a folder")
    try:
        sweep = build_sweep(args)
        runs = expand(sweep)
        traces = load_traces(sweep.traces) if sweep.traces is not None else default_traces()
        validate(runs, traces)
    except (ValueError, SettingsError, TraceError) as e:
        raise UsageError(str(e)) from None
    quiet = bool(args.quiet)
    store = RunStore(args.out, traces)
    store.prepare()
    done, todo = partition(runs, store, args.fresh)
    executor, where = _executor(args)
    if not quiet:
        print(f"mori sweep {sweep.name or '(custom)'}: {len(runs)} runs in "
              f"{len(settings_of(runs))} settings; {len(done)} already recorded in "
              f"{store.runs_dir}; running {len(todo)} on {where}", file=sys.stderr)
    try:
        new = execute(todo, traces, store, executor, len(runs), quiet)
    except KeyboardInterrupt:
        kept = sum(store.load(r) is not None for r in runs)
        print(f"mori sweep: interrupted; {kept} of {len(runs)} runs are recorded in "
              f"{store.runs_dir}; run the same command again to resume", file=sys.stderr)
        return 130
    except SettingsError as e:
        raise UsageError(str(e)) from None
    results = [done[r] if r in done else new[r] for r in runs]
    written = write_outputs(args.out, sweep, runs, results, store)
    print(summary(runs, results), flush=True)
    note = left_out_note(results, traces.name, len(traces.programs), sweep.base.max_context)
    if not quiet:
        if note:
            print(note, file=sys.stderr)
        print(f"wrote {len(written)} files to {args.out}", file=sys.stderr)
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    """Run ``mori sweep`` with parsed ``args``; return the exit status."""
    try:
        return _run(args)
    except (UsageError, ray_exec.RayUnavailableError) as e:
        print(f"mori sweep: error: {e}", file=sys.stderr)
        return 2
    except ray_exec.RayStartError as e:
        print(f"mori sweep: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"mori sweep: error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mori sweep: interrupted", file=sys.stderr)
        return 130
