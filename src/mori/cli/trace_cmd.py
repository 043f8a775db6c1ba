"""``mori trace``: import agent recordings, analyse a trace set, generate one.

* ``mori trace import FORMAT PATH... -o OUT``: convert recordings to MORI's canonical
  trace file, streaming (one program in memory at a time).
* ``mori trace stats PATH``: the paper's workload analysis of any importable trace set.
* ``mori trace synth -o OUT``: agent programs with given statistics.

``add_trace_parser(sub)`` adds the command to ``mori``'s subparsers; ``run_trace(args)``
runs it. Exit status: 0 on success, 2 for bad input (one line on stderr, naming the file
and line at fault), 1 when an output cannot be written.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, cast

from tqdm import tqdm

from mori.traces.errors import TraceError
from mori.traces.import_common import ImportOptions
from mori.traces.importers import IMPORTERS
from mori.traces.jsonl import TraceWriter, write_traceset
from mori.traces.loading import load_traces
from mori.traces.stats import DEFAULT_THRESHOLD_S, analyze, format_stats, to_json
from mori.traces.synth import SynthSpec, synthesize

_FORMATS = "\n".join(
    textwrap.fill(f"{name}: {IMPORTERS.get(name).description}", 86, initial_indent="  ",
                  subsequent_indent="    ")
    for name in IMPORTERS.names())

IMPORT_EPILOG = f"""\
formats:
{_FORMATS}

The output is MORI's canonical trace file (JSON Lines, gzip when OUT ends in .gz; schema
in docs/traces.md), read by `mori simulate --traces`, `mori trace stats` and the replay
client. A bad line fails the import, naming its file and line; --skip-bad skips such
lines and reports how many. Claude Code lines of a type the importer does not know
(newer versions add some), and TraceLab fields and event types it does not know, are
skipped and counted by name in the summary; --strict refuses them instead, naming the
file and line.

examples:
  mori trace import claude-code ~/.claude/projects/-home-me-repo -o repo.jsonl.gz
  mori trace import codex ~/.codex/sessions -o codex.jsonl.gz --skip-bad
  mori trace import tracelab syfi_coding_trace.jsonl.gz -o syfi.jsonl.gz
  mori trace import tracelab syfi_coding_trace.duckdb -o syfi.jsonl.gz  # mori[tracelab]
  mori trace import kv-cache-tester traces/ -o kv.jsonl.gz
"""

STATS_EPILOG = """\
PATH is any importable trace set (its format is detected): a canonical file, a
kv-cache-tester folder or file, a Claude Code project folder or session, a Codex
sessions folder or rollout; or the name of a shipped set (see `mori traces`), such as
kv-cache-tester-31, when no file of that name exists. Definitions (wait, busy phase,
idle fraction, context growth) are in docs/traces.md; the paper's figures are printed
beside ours. A set of programs recorded by more than one agent (provider: claude,
codex; unknown when the recording does not say) gets one column per provider beside
the whole set's (`all`), and a "by_provider" object in --json; --provider restricts the
analysis to one provider's programs.

examples:
  mori trace stats traces.jsonl.gz
  mori trace stats tracelab.jsonl.gz --provider codex
  mori trace stats kv-cache-tester-31
  mori trace stats ~/.claude/projects/-home-me-repo --threshold 1 --plot figs/
  mori trace stats kv/ --json > stats.json
"""

SYNTH_EPILOG = """\
The defaults are the paper's figures: 87 % of tool calls under 2 s holding 42 % of tool
time, busy phases of median 20 s and p90 81 s; contexts start near 20k tokens and grow
~1k tokens a call. `mori trace stats` on the output at the same threshold reports the
asked shares within 1 percentage point and the phase median and p90 within 5 %
(at 20 programs or more).

--like PATH fits these figures to a trace set instead (any PATH `mori trace stats`
takes; with --provider, to that provider's programs only), measured at --threshold,
and prints the spec to stderr, each field marked fitted, given or default. Options
given beside --like override the fitted values; --programs defaults to the source's
count. Without --like, --provider only labels the generated programs.

examples:
  mori trace synth --programs 100 --seed 1 -o synth.jsonl.gz
  mori trace synth --programs 50 --short-calls 0.8 --busy-median 30 --busy-p90 120 -o s.jsonl
  mori trace synth --like tracelab.jsonl.gz --provider claude --seed 2 -o like.jsonl.gz
  mori trace synth --like kv-cache-tester-31 --programs 200 --busy-median 10 -o s.jsonl
"""


def add_trace_parser(sub: Any) -> argparse.ArgumentParser:
    """Add ``trace`` (with ``import``, ``stats``, ``synth``) to ``mori``'s subparsers."""
    trace = sub.add_parser(
        "trace", help="import, analyse and generate agent traces",
        description="Import agent recordings into MORI's trace format, analyse a trace "
        "set as the paper does, or generate programs with given statistics.")
    inner = trace.add_subparsers(dest="trace_command", title="trace commands",
                                 metavar="COMMAND")
    imp = inner.add_parser(
        "import", help="convert recordings to a canonical trace file",
        description="Convert agent recordings to MORI's canonical trace file.",
        epilog=IMPORT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    imp.add_argument("format", metavar="FORMAT", choices=IMPORTERS.names(),
                     help="input format: " + ", ".join(IMPORTERS.names()))
    imp.add_argument("paths", metavar="PATH", nargs="+", type=Path,
                     help="files or folders (folders are searched recursively)")
    imp.add_argument("-o", "--output", required=True, type=Path, metavar="OUT",
                     help="output file (.jsonl, or .jsonl.gz for gzip)")
    imp.add_argument("--name", help="trace set name (default: the first PATH's name)")
    imp.add_argument("--skip-bad", action="store_true",
                     help="skip malformed lines (counted) instead of failing")
    imp.add_argument("--strict", action="store_true",
                     help="refuse lines of unknown types (Claude Code) and unknown fields "
                     "and event types (TraceLab) instead of skipping and counting them")
    imp.add_argument("--no-hashes", action="store_true",
                     help="drop block hashes (kv-cache-tester) to keep the file small")
    imp.add_argument("--quiet", action="store_true", help="no progress bar or summary")

    st = inner.add_parser(
        "stats", help="the paper's workload analysis of a trace set",
        description="Tool-call durations, short-call shares, busy phases, idle fractions, "
        "context growth and LLM calls per program; subagents apart.",
        epilog=STATS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("path", metavar="PATH", type=Path,
                    help="an importable trace set, or a shipped set's name")
    st.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD_S, metavar="S",
                    help=f"short/long tool-call threshold in seconds (default "
                    f"{DEFAULT_THRESHOLD_S:g}); busy phases are also shown at 1, 2 and 5 s")
    st.add_argument("--format", choices=IMPORTERS.names(), dest="trace_format",
                    help="the input format (default: detected)")
    st.add_argument("--json", action="store_true", help="print JSON instead of text")
    st.add_argument("--provider", metavar="P",
                    help="analyse only the programs of provider P (claude, codex, or "
                    "unknown for those without one)")
    st.add_argument("--plot", type=Path, metavar="DIR",
                    help="write tool_gaps_cdf.png, busy_phases_cdf.png and "
                    "context_growth.png into DIR")

    sy = inner.add_parser(
        "synth", help="generate agent programs with given statistics",
        description="Generate agent programs whose workload statistics are given.",
        epilog=SYNTH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SynthSpec()
    sy.add_argument("--like", type=Path, metavar="PATH",
                    help="fit the statistics to this trace set (or a shipped set's name); "
                    "options given beside it override the fitted values")
    sy.add_argument("--provider", metavar="P",
                    help="with --like, fit to provider P's programs only (claude, codex, "
                    "unknown); without, label the generated programs P")
    sy.add_argument("--programs", type=int, metavar="N",
                    help=f"number of programs (default {d.programs}, or the --like set's)")
    sy.add_argument("--seed", type=int, metavar="S", help=f"random seed (default {d.seed})")
    sy.add_argument("-o", "--output", required=True, type=Path, metavar="OUT",
                    help="output file (.jsonl, or .jsonl.gz for gzip)")
    sy.add_argument("--threshold", type=float, metavar="S",
                    help=f"short/long threshold in seconds (default {d.threshold_s:g})")
    sy.add_argument("--short-calls", type=float, metavar="F",
                    help=f"share of tool calls under the threshold (default "
                    f"{d.short_calls_frac:g})")
    sy.add_argument("--short-time", type=float, metavar="F",
                    help=f"share of tool time they hold (default {d.short_time_frac:g})")
    sy.add_argument("--busy-median", type=float, metavar="S",
                    help=f"busy-phase median in seconds (default {d.busy_median_s:g})")
    sy.add_argument("--busy-p90", type=float, metavar="S",
                    help=f"busy-phase p90 in seconds (default {d.busy_p90_s:g})")
    sy.add_argument("--phases", type=float, metavar="N",
                    help=f"median busy phases per program (default {d.phases_median:g})")
    sy.add_argument("--first-prompt", type=int, metavar="TOKENS",
                    help=f"median first prompt (default {d.first_prompt_median})")
    sy.add_argument("--growth", type=float, metavar="TOKENS",
                    help=f"mean context growth per call (default {d.growth_per_call:g})")
    sy.add_argument("--output-tokens", type=int, metavar="TOKENS",
                    help=f"median output of a call (default {d.output_median})")
    sy.add_argument("--max-context", type=int, metavar="TOKENS",
                    help=f"compact a context that would pass this (default {d.max_context})")
    sy.add_argument("--name", default="", help="trace set name (default: synth-N-seedS)")
    trace.set_defaults(trace_parser=trace)
    return cast(argparse.ArgumentParser, trace)


def run_trace(args: argparse.Namespace) -> int:
    """Run ``mori trace`` with parsed ``args``; return the exit status."""
    command = getattr(args, "trace_command", None)
    if command is None:
        args.trace_parser.print_help(sys.stderr)
        return 2
    try:
        if command == "import":
            return _import(args)
        if command == "stats":
            return _stats(args)
        return _synth(args)
    except (TraceError, ValueError) as e:
        print(f"mori trace {command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # the reader stopped early: `mori` ends quietly
    except OSError as e:
        print(f"mori trace {command}: error: {e.filename or ''}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mori trace {command}: interrupted", file=sys.stderr)
        return 130


def _import(args: argparse.Namespace) -> int:
    importer = IMPORTERS.get(args.format)
    paths: list[Path] = args.paths
    files = importer.files(paths)
    total = sum(f.stat().st_size for f in files)
    options = ImportOptions(skip_bad=args.skip_bad, strict=args.strict,
                            keep_hashes=not args.no_hashes)
    name = args.name or _set_name(paths[0])
    out: Path = args.output
    try:
        with tqdm(total=total, desc=f"importing {args.format}", unit="B", unit_scale=True,
                  file=sys.stderr, disable=args.quiet, dynamic_ncols=True) as bar:
            options.progress = bar.update
            with TraceWriter(out, name) as writer:
                for program in importer.programs(paths, options):
                    writer.write(program)
    except BaseException:
        out.unlink(missing_ok=True)  # no partial output
        raise
    report = options.report
    if report.programs == 0:
        out.unlink(missing_ok=True)
        print(f"mori trace import: error: no LLM call found in {len(files)} {args.format} "
              "file(s)", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"wrote {args.output}: {report.summary()}", file=sys.stderr)
        for note in report.notes:
            print(f"note: {note}", file=sys.stderr)
        for example in report.bad_examples:
            print(f"skipped: {example}", file=sys.stderr)
    return 0


def _set_name(path: Path) -> str:
    resolved = path.resolve()
    return resolved.name.split(".jsonl")[0].split(".json")[0] or "traces"


def _stats(args: argparse.Namespace) -> int:
    from mori.traces.stats import analyze_by_provider, empty_set_note, select_provider

    if not args.threshold > 0:
        raise ValueError(f"--threshold must be positive, got {args.threshold}")
    ts = load_traces(args.path, format=args.trace_format)
    if args.provider is not None:
        ts = select_provider(ts, args.provider)
    if (empty := empty_set_note(ts)) is not None:
        print(f"warning: {empty}", file=sys.stderr)
    stats = analyze(ts, threshold_s=args.threshold)
    by_provider = (analyze_by_provider(ts, threshold_s=args.threshold)
                   if len(stats.providers) > 1 else None)
    if args.json:
        print(json.dumps(to_json(stats, by_provider), indent=2))
    else:
        print(format_stats(stats, by_provider=by_provider))
    if args.plot is not None:
        from mori.cli.trace_plot import plot_trace_stats

        for path in plot_trace_stats(ts, stats, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def _synth(args: argparse.Namespace) -> int:
    """SynthSpec's defaults, or the spec fitted to --like's set, with the options given
    (not ``None``) put over it; then generate."""
    from dataclasses import replace

    from mori.traces.synth_fit import describe, fit_spec, with_overrides

    flags = {"programs": "programs", "seed": "seed", "threshold": "threshold_s",
             "short_calls": "short_calls_frac", "short_time": "short_time_frac",
             "busy_median": "busy_median_s", "busy_p90": "busy_p90_s",
             "phases": "phases_median", "first_prompt": "first_prompt_median",
             "growth": "growth_per_call", "output_tokens": "output_median",
             "max_context": "max_context", "name": "name"}
    given: dict[str, Any] = {field: getattr(args, dest) for dest, field in flags.items()
                             if getattr(args, dest) not in (None, "")}
    d = SynthSpec()
    if args.like is None:
        if args.provider is not None:
            given["provider"] = "" if args.provider == "unknown" else args.provider
        spec = replace(d, **given)
    else:
        source = load_traces(args.like)
        fitted = fit_spec(source, threshold_s=given.get("threshold_s", d.threshold_s),
                          provider=args.provider, programs=given.get("programs"),
                          seed=given.get("seed", d.seed))
        spec = with_overrides(fitted, given)
        which = "" if args.provider is None else f", provider {args.provider}"
        print(f"spec fitted to {source.name!r}{which} at {spec.threshold_s:g} s:",
              file=sys.stderr)
        print(describe(spec, given), file=sys.stderr)
    ts = synthesize(spec)
    write_traceset(ts, args.output)
    steps = sum(len(p.steps) for p in ts.programs)
    print(f"wrote {args.output}: {len(ts)} programs, {steps} steps", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone ``mori`` parser with only the ``trace`` command (for tests and
    ``python -m mori.cli.trace_cmd``)."""
    parser = argparse.ArgumentParser(prog="mori")
    add_trace_parser(parser.add_subparsers(dest="command"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """``mori trace ...`` without the rest of ``mori``: ``argv`` starts with ``trace``."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command != "trace":
        return 2
    return run_trace(args)


if __name__ == "__main__":
    sys.exit(main())
