"""The ``mori`` command: ``simulate``, ``sweep``, ``trace``, ``traces``, ``serve``,
``replay``, ``engine-sim``, ``vllm-args``, ``sglang-args``, ``dynamo-router``, ``policies``, ``presets`` and
``--version``.

``main(argv)`` returns the exit status: 0 on success, 2 for a usage error (reported in
one line on stderr, no traceback), 1 when an output file cannot be written.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path
from typing import NoReturn

from mori import __version__
from mori.cli.config_file import ConfigError, load_config, valid_keys
from mori.cli.dynamo_router_cmd import add_dynamo_router_parser, run_dynamo_router
from mori.cli.engine_sim_cmd import add_engine_sim_parser, run_engine_sim
from mori.cli.options import OPTIONS, add_options
from mori.cli.replay_cmd import add_replay_parser, run_replay
from mori.cli.serve_cmd import add_serve_parser, run_serve
from mori.cli.sglang_args_cmd import add_sglang_args_parser, run_sglang_args
from mori.cli.simulate_cmd import UsageError, resolve_settings, run_simulate
from mori.cli.sweep_cmd import add_sweep_parser, run_sweep
from mori.cli.table import format_table
from mori.cli.trace_cmd import add_trace_parser, run_trace
from mori.cli.traces_cmd import add_traces_parser, run_traces
from mori.cli.vllm_args_cmd import add_vllm_args_parser, run_vllm_args
from mori.core.costmodel import PRESETS
from mori.core.hardware import DISKS
from mori.core.policies import PAPER_POLICIES, POLICIES

_NO_CPU_TIER = [n for n in POLICIES.names() if not POLICIES.get(n).engine_profile.cpu_tier]

SIMULATE_EPILOG = f"""\
grid:
  One run per hardware x cpu ratio x programs x policy, in that order (policy varies
  fastest); the table, --json and --plot keep this order whatever --jobs is. --programs
  counts programs per replica (x --replicas in all). With no options: the paper's
  comparison (4 policies x 20/50/80 programs, h200-qwen3-30b-a3b, cpu ratio 1, one
  simulated hour).

cpu ratio R:
  The CPU KV tier holds R x the GPU KV capacity of KV that is *not* on the GPU. The
  engine writes through, so its host pool is (1 + R) x the device pool (it also mirrors
  what is on the GPU). R = 0: no CPU tier. Policies whose engine has no CPU tier
  ({', '.join(_NO_CPU_TIER)}) ignore R.

human gap (--human-gap, --human-gap-cap):
  A gap after a final answer is a person reading and typing, not a tool. "cap" (the
  default) limits it to --human-gap-cap seconds; "replace" substitutes the program's
  median tool gap (itself at most the cap; the cap when the program has no tool gaps).

context window (--max-context):
  A program's steps are kept while prompt + output fit the context window (the model's,
  or --max-context); the rest is cut, as a real session would have compacted there. A
  program whose first step does not fit is left out; a note on stderr after the table
  says how many were (not with --quiet). The cut is in trace tokens: with --token-scale S the model's window counts
  as window / S trace tokens, as `mori replay` cuts.

config file (--config FILE.toml):
{textwrap.fill("Keys are the long options above, with dashes or underscores: "
                + ", ".join(valid_keys()) + ".", 88, initial_indent="  ", subsequent_indent="  ",
                break_on_hyphens=False)}
  List options take arrays (policy = ["mori", "smg"], programs = [20, 50]); flags on the
  command line override the file; relative paths are relative to the file's folder.

examples:
  mori simulate
  mori simulate --policy mori,smg --programs 20,50 --duration 600 --json out.json
  mori simulate --preset h200-qwen3-30b-a3b,b200-llama3.1-70b-tp2 --cpu-ratio 0.5,1,2 \\
      --jobs 8 --plot grid.png
"""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, with a pointer to ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``mori`` argument parser with its subcommands."""
    parser = _Parser(
        prog="mori", description="MORI: idleness-ranked KV-cache tiering for agentic LLM "
        "programs. Run `mori COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"mori {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    sim = sub.add_parser(
        "simulate", help="run the discrete-event simulator over a grid of settings",
        description="Replay agentic programs closed-loop against simulated LLM engine\n"
        "replicas under each KV-cache policy; print one table row per run.",
        epilog=SIMULATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(sim, OPTIONS)
    sim.add_argument("--config", type=Path, metavar="FILE.toml",
                     help="read options from a TOML file (see below); flags given here win")
    add_sweep_parser(sub)
    add_trace_parser(sub)
    add_traces_parser(sub)
    add_serve_parser(sub)
    add_replay_parser(sub)
    add_engine_sim_parser(sub)
    add_vllm_args_parser(sub)
    add_sglang_args_parser(sub)
    add_dynamo_router_parser(sub)
    sub.add_parser("policies", help="list the registered policies",
                   description="List the registered scheduling policies.")
    sub.add_parser("presets", help="list the hardware presets and the disk tiers",
                   description="List the hardware presets (one engine replica each) and the "
                               "drives a disk tier can be simulated on (--disk).")
    return parser


def list_policies() -> str:
    """The policy listing: name, whether the paper compares it, description."""
    rows = [(n, "*" if n in PAPER_POLICIES else "", POLICIES.get(n).description)
            for n in POLICIES.names()]
    table = format_table(("policy", "paper", "description"), rows)
    return table + "\n\n* the paper's main comparison (the default of `mori simulate`)"


def list_presets() -> str:
    """The preset listing: GPU, model, tensor parallelism, KV capacity, context window."""
    rows = []
    for name in PRESETS.names():
        p = PRESETS.get(name)
        rows.append((name, p.gpu.name, p.model.name, str(p.tp),
                     f"{p.gpu_kv_capacity_tokens:,}", f"{p.model.context_window:,}"))
    headers = ("preset", "GPU", "model", "TP", "GPU KV (tokens)", "context (tokens)")
    presets = format_table(headers, rows, (False, False, False, True, True, True))
    disks = [(name, f"{d.capacity_bytes / 1e12:.1f}", f"{d.read_bw / 1e9:g}",
              f"{d.write_bw / 1e9:g}", f"{d.latency_s * 1e6:g}")
             for name, d in ((n, DISKS.get(n)) for n in DISKS.names())]
    disk_table = format_table(("disk (--disk)", "capacity (TB)", "read (GB/s)", "write (GB/s)",
                               "read latency (us)"), disks, (False, True, True, True, True))
    return f"{presets}\n\n{disk_table}"


def _simulate(args: argparse.Namespace) -> int:
    cli = {o.key: getattr(args, o.key) for o in OPTIONS}
    config = load_config(args.config) if args.config is not None else {}
    return run_simulate(resolve_settings(cli, config))


def main(argv: list[str] | None = None) -> int:
    """Run ``mori`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status.

    A reader that stops early (``mori ... | head``) ends the command quietly, with the
    status a shell gives a command killed by SIGPIPE (141).
    """
    try:
        return _run(argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        return 141


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's own usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "policies":
        print(list_policies())
        return 0
    if args.command == "presets":
        print(list_presets())
        return 0
    if args.command == "sweep":
        return run_sweep(args)
    if args.command == "trace":
        return run_trace(args)
    if args.command == "traces":
        return run_traces(args)
    if args.command == "serve":
        return run_serve(args)
    if args.command == "replay":
        return run_replay(args)
    if args.command == "engine-sim":
        return run_engine_sim(args)
    if args.command == "vllm-args":
        return run_vllm_args(args)
    if args.command == "sglang-args":
        return run_sglang_args(args)
    if args.command == "dynamo-router":
        return run_dynamo_router(args)
    try:
        return _simulate(args)
    except (UsageError, ConfigError) as e:
        print(f"mori simulate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mori simulate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
