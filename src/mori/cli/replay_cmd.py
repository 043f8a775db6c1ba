"""``mori replay``: replay traces closed-loop against a live OpenAI-compatible endpoint.

The simulator's replay rules (:mod:`mori.sim.plan`), sent as real streamed chat
completions to a MORI gateway or to an engine directly (:mod:`mori.replay`); the result
table and ``--json`` carry ``mori simulate``'s metric names, measured at the client, in
simulated seconds (wall x ``--time-scale``). Usage problems and an unreachable target
exit with status 2 and one line on stderr; an output file that cannot be written, 1.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from mori.cli.options import BY_KEY, Option, add_options, help_text
from mori.cli.table import format_table
from mori.replay.client import ReplayProgress, replay
from mori.replay.config import ReplayConfig, ReplaySettingsError
from mori.replay.metrics import ReplayResult
from mori.replay.target import TargetError
from mori.sim.config import SimConfig
from mori.traces import TraceError, TraceSet, default_traces, load_traces

_SIM = SimConfig()
_DEFAULTS = ReplayConfig(target="http://localhost", programs=1)


def _opt(key: str, **changes: Any) -> Option:
    return dataclasses.replace(BY_KEY[key], **changes)


REPLAY_OPTIONS: tuple[Option, ...] = (
    Option("target", str, None, metavar="URL",
           help="base URL of a MORI gateway or an OpenAI-compatible engine, e.g. "
                "http://localhost:8000 (required)"),
    Option("programs", int, None, metavar="N",
           help="concurrent agentic programs (closed-loop slots) (required)"),
    _opt("traces"),
    _opt("duration", help="simulated seconds to replay (wall: this / --time-scale)"),
    Option("time_scale", float, _DEFAULTS.time_scale, metavar="X",
           help="simulated seconds per wall second: gaps are slept / X and times are reported "
                "x X; use the factor the target's simulated engines or gateway run at"),
    _opt("seed"),
    Option("stagger", float, _SIM.stagger_s, metavar="S",
           help="programs start uniformly spread over S simulated seconds (seeded)"),
    _opt("human_gap", help=BY_KEY["human_gap"].help.replace(" (see below)", "")
         + " (as in `mori simulate`)"),
    _opt("human_gap_cap"),
    _opt("max_context", help="cut programs at this context length, trace tokens (default: the "
                             "model's max_model_len / --token-scale if the target reports it, "
                             "else no cut)"),
    Option("model", str, None, metavar="NAME",
           help="model to request (default: the first one GET /v1/models lists)"),
    Option("text_prompts", bool, False,
           help="send prompts as text of about the trace's token count (4 characters a "
                "token, the program's previous prompt kept as prefix), for engines that do "
                "not honour MORI's synthetic `mori` prompt field (default: off)"),
    Option("token_scale", float, _DEFAULTS.token_scale, metavar="F",
           help="multiply every token count sent (prompt, reuse, max_tokens) by F, e.g. 0.01 "
                "for a small engine"),
    Option("api_key", str, _DEFAULTS.api_key, metavar="KEY", help="API key to send"),
    Option("request_timeout", float, _DEFAULTS.request_timeout_s, metavar="S",
           help="give up on a request after S wall seconds (counted as a timeout error)"),
    Option("end_on_error", bool, False,
           help="end a program at its first failed request instead of going on after its "
                "gap (default: off)"),
    _opt("json", help="also write the run's metrics to FILE (a JSON list of one run, as "
                      "`mori simulate --json`)"),
    Option("events", Path, None, metavar="FILE.jsonl",
           help="also write one JSON line per request: program id, step, sent, first-token "
                "and end times (simulated seconds), output tokens, error"),
    _opt("quiet"),
)
"""The options of ``mori replay``, in help order."""

EPILOG = """\
The replay follows `mori simulate`'s rules: --programs slots started over --stagger
seconds, the trace order shuffled by --seed, each program sending its next request only
after its previous response and its recorded gap, subagents running while their parent
waits, program ids NAME#K. Each request is a streamed chat completion carrying
`program_id` and `mori` = {prompt_tokens, reuse_tokens} (or, with --text-prompts, a text
prompt of that size). At a program's end the replayer POSTs /v1/programs/ID/release (an
engine answering 404 is not asked again). Failed requests are counted by kind.

examples:
  mori replay --target http://localhost:8000 --programs 20 --duration 600 --time-scale 10
  mori replay --target http://localhost:8001 --traces traces.jsonl --programs 4 \\
      --text-prompts --token-scale 0.01 --duration 120 --json replay.json
"""


def add_replay_parser(sub: Any) -> None:
    """Register ``replay`` on the ``mori`` subcommand action ``sub``."""
    p = sub.add_parser(
        "replay", help="replay traces closed-loop against a live gateway or engine",
        description="Replay agentic programs closed-loop, as a real OpenAI-compatible\n"
        "client, against a MORI gateway or an engine; print the client-side metrics.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, REPLAY_OPTIONS, help_text)


class _Usage(ValueError):
    pass


def settings_from_args(args: argparse.Namespace) -> tuple[ReplayConfig, dict[str, Any]]:
    """The :class:`ReplayConfig` of parsed ``args`` and the other option values."""
    values = {o.key: o.default for o in REPLAY_OPTIONS}
    values.update({o.key: getattr(args, o.key) for o in REPLAY_OPTIONS
                   if getattr(args, o.key, None) is not None})
    for key in ("target", "programs"):
        if values[key] is None:
            raise _Usage(f"--{key} is required")
    for key in ("json", "events"):
        path = values[key]
        if path is not None and not path.parent.is_dir():
            raise _Usage(f"--{key} {str(path)!r}: folder {str(path.parent)!r} does not exist")
    try:
        config = ReplayConfig(
            target=values["target"], programs=values["programs"], duration_s=values["duration"],
            time_scale=values["time_scale"], seed=values["seed"], stagger_s=values["stagger"],
            human_gap=values["human_gap"], human_gap_cap_s=values["human_gap_cap"],
            max_context=values["max_context"], model=values["model"],
            text_prompts=values["text_prompts"], token_scale=values["token_scale"],
            api_key=values["api_key"], request_timeout_s=values["request_timeout"],
            end_on_error=values["end_on_error"])
    except ValueError as e:
        raise _Usage(str(e)) from None
    return config, values


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


RESULT_HEADERS = ("target", "programs", "tok/s", "steps/s", "TTFT mean (s)", "TTFT p50 (s)",
                  "TTFT p90 (s)", "TTFT p99 (s)", "requests", "errors")
GATEWAY_HEADERS = ("promotions", "demotions cpu", "demotions none", "held")


def result_table(results: Sequence[ReplayResult]) -> str:
    """One row per replay; the gateway's counters when any target was a MORI gateway."""
    gateway = any(r.gateway for r in results)
    disk = gateway and any(r.demotions_to_disk for r in results)

    def count(v: int | None) -> str:
        return "-" if v is None else str(v)

    rows = []
    for r in results:
        row = [r.target, str(r.programs), _num(r.output_tokens_per_s, ".1f"),
               _num(r.steps_per_s, ".3f"), _num(r.ttft_mean_s, ".2f"), _num(r.ttft_p50_s, ".2f"),
               _num(r.ttft_p90_s, ".2f"), _num(r.ttft_p99_s, ".2f"), str(r.requests),
               str(r.error_count)]
        if gateway:
            row += [count(r.promotions), count(r.demotions_to_cpu), count(r.demotions_to_none),
                    count(r.held_requests)]
            if disk:
                row.append(count(r.demotions_to_disk))
        rows.append(row)
    headers = (RESULT_HEADERS + (GATEWAY_HEADERS if gateway else ())
               + (("demotions disk",) if disk else ()))
    return format_table(headers, rows, [False] + [True] * (len(headers) - 1))


def notes(r: ReplayResult, trace_set: TraceSet) -> list[str]:
    """Lines under the table: errors by kind, programs left out."""
    out = []
    if r.errors:
        kinds = ", ".join(f"{k} {n}" for k, n in r.errors.items())
        out.append(f"failed requests: {kinds}")
    if r.release_errors:
        out.append(f"failed release calls: {r.release_errors}")
    if r.programs_left_out:
        out.append(f"note: {r.programs_left_out} of the {len(trace_set.programs)} programs of "
                   f"trace set {trace_set.name!r} were left out: their first step does not fit "
                   f"the context window ({r.max_context:,} tokens)")
    return out


def _run(config: ReplayConfig, traces: TraceSet, quiet: bool) -> ReplayResult:
    """The replay, with a progress bar over simulated time once the target answered."""
    bars: list[tqdm[Any]] = []

    def progress(p: ReplayProgress) -> None:
        if not bars:
            bars.append(tqdm(
                total=round(config.duration_s), desc="replaying", unit="s", file=sys.stderr,
                disable=quiet, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt} simulated s "
                           "[{elapsed}<{remaining}{postfix}]"))
        bar = bars[0]
        bar.n = min(p.elapsed_s, bar.total)
        bar.set_postfix_str(f"steps={p.steps} errors={p.errors} live={p.live}", refresh=False)
        bar.refresh()

    try:
        return asyncio.run(replay(config, traces, progress))
    finally:
        for bar in bars:
            bar.close()


def run_replay(args: argparse.Namespace) -> int:
    """Run ``mori replay`` with parsed ``args``; return the exit status."""
    try:
        config, values = settings_from_args(args)
        path = values["traces"]
        traces = load_traces(path) if path is not None else default_traces()
        result = _run(config, traces, values["quiet"])
    except (_Usage, TraceError, ReplaySettingsError) as e:
        print(f"mori replay: error: {e}", file=sys.stderr)
        return 2
    except TargetError as e:
        print(f"mori replay: error: {e}; start a server there (a MORI gateway, or an engine "
              "such as `vllm serve MODEL`) or pass its URL with --target", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mori replay: interrupted", file=sys.stderr)
        return 130
    print(result_table([result]))
    for line in notes(result, traces):
        print(line)
    written = []
    try:
        if values["json"] is not None:
            values["json"].write_text(json.dumps([result.to_dict()], sort_keys=True, indent=2,
                                                 allow_nan=False) + "\n", encoding="utf-8")
            written.append(str(values["json"]))
        if values["events"] is not None:
            with values["events"].open("w", encoding="utf-8") as f:
                for event in result.to_dict(events=True)["events"]:
                    f.write(json.dumps(event, sort_keys=True) + "\n")
            written.append(str(values["events"]))
    except OSError as e:
        print(f"mori replay: error: cannot write {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    if written and not values["quiet"]:
        print(f"wrote {', '.join(written)}", file=sys.stderr)
    return 0
