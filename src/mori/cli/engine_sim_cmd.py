"""``mori engine-sim``: serve one simulated engine replica as an OpenAI- and
Anthropic-compatible server, optionally answering from a script (``--script``,
``--script-from-trace``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar

from mori.cli.eventloop import run_loop
from mori.core.costmodel import PRESETS
from mori.engines.simulated import TOKEN_ENV
from mori.sim.script import Script, ScriptError, load_script, script_from_trace
from mori.traces.errors import TraceError
from mori.traces.model import ProgramTrace

P = TypeVar("P", bound=argparse.ArgumentParser)

EPILOG = """\
The server runs the simulator's engine replica model (continuous batching, paged GPU
and CPU KV pools, the preset's cost model) against the wall clock: simulated time =
wall time x --time-scale. A chat or completions request generates exactly max_tokens
placeholder tokens (default 16); a Messages or Responses request 16 (fewer under its
max_tokens). A request's prompt size is the body's `mori.prompt_tokens` if given, else
ceil(characters / 4) of its text. The program is the X-Program-Id header
(percent-encoded UTF-8) or the body's program_id.

A script (--script FILE, JSON or TOML) makes the answers call tools, to drive a real
agent: {"steps": [{"text": "...", "tool": {"Bash": {...}, "shell": {...}}}, {"text":
"Done."}], "fallback": "OK."}; a request at step k (its tool results since its last
prompt) calls the first of step k's tools that it offers. --script-from-trace calls
`sleep GAP` for each tool gap of a recorded program (see examples/agent-script.json,
docs/agents.md and mori.sim.script: per-tool "requires", Codex's namespaced subagent
tools, {{result.NAME}} inputs).

endpoints:
  POST /v1/chat/completions, /v1/completions   (stream or not)
  POST /v1/messages, /v1/responses              (stream or not)
  POST /v1/messages/count_tokens
  GET  /v1/models, /health, /metrics
  POST /mori/v1/programs/PID/{label,offload,drop,release}
  GET  /mori/v1/{residency,capacity,stats}
With --token (or MORI_ENGINE_TOKEN), every endpoint but GET /health needs
'Authorization: Bearer TOKEN'.

examples:
  mori engine-sim --preset h200-qwen3-30b-a3b --port 8001
  mori engine-sim --preset h200-qwen3-30b-a3b --port 8001 --cpu-ratio 1 --typed-eviction
  mori engine-sim --preset h200-80g-qwen2.5-7b --port 0 --time-scale 10 --gpu-kv-tokens 65536
  mori engine-sim --preset h200-qwen3-30b-a3b --script examples/agent-script.json
  mori engine-sim --preset h200-qwen3-30b-a3b --script-from-trace run.jsonl.gz --program p3
"""


def _number(kind: type[float] | type[int], low: float, strict: bool
            ) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` above ``low`` (``strict``) or at least it."""
    def parse(text: str) -> float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if not (v > low if strict else v >= low) or v == float("inf"):
            raise argparse.ArgumentTypeError(
                f"must be {'positive' if strict else f'>= {low:g}'}, got {text}")
        return v
    return parse


_positive_float = _number(float, 0, strict=True)
_non_negative_float = _number(float, 0, strict=False)
_positive_int = _number(int, 0, strict=True)


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {text}")
    return v


def add_engine_sim_parser(sub: argparse._SubParsersAction[P]) -> P:
    """Add the ``engine-sim`` subcommand to ``sub``; returns its parser."""
    p = sub.add_parser(
        "engine-sim", help="serve a simulated engine replica (OpenAI-compatible, real time)",
        description="Serve one simulated LLM engine replica as an OpenAI-compatible HTTP "
        "server, with MORI's KV controls, in real time (optionally time-scaled).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=PRESETS.names(), metavar="NAME",
                   help="hardware preset: GPU, model, KV pool, cost model "
                        f"({', '.join(PRESETS.names())}; see `mori presets`)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000,
                   help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, metavar="X",
                   help="simulated seconds per wall second; 10 runs the model 10x faster "
                        "than the hardware it models (default: 1)")
    p.add_argument("--cpu-ratio", type=_non_negative_float, default=0.0, metavar="R",
                   help="CPU KV tier size as a multiple of the GPU KV pool; 0: no CPU tier "
                        "(default: 0)")
    p.add_argument("--typed-eviction", action="store_true",
                   help="evict and admit by the busy/idle/inactive labels set through "
                        "/mori/v1/programs/PID/label (MORI's engine), not plain LRU")
    p.add_argument("--gpu-kv-tokens", type=_positive_int, default=None, metavar="N",
                   help="GPU KV pool size in tokens (default: the preset's)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="served model name (default: the preset's model name)")
    p.add_argument("--max-queue", type=int, default=0, metavar="N",
                   help="refuse requests (503) when N are waiting for admission; 0: no limit")
    p.add_argument("--token", default=None, metavar="TOKEN",
                   help="require 'Authorization: Bearer TOKEN' on every request but GET "
                        "/health (401 without it); give it to the gateway as --backend "
                        "sim=URL,token=TOKEN (default: the environment variable "
                        "MORI_ENGINE_TOKEN, which the gateway's sim backends read too; "
                        "unset: no token)")
    script = p.add_mutually_exclusive_group()
    script.add_argument("--script", default=None, metavar="FILE",
                        help="answer from this script (JSON, or TOML by its .toml suffix): "
                             "text and tool calls, step by step")
    script.add_argument("--script-from-trace", default=None, metavar="TRACE",
                        help="answer with a script that sleeps through each tool gap of a "
                             "recorded program (any trace `mori simulate --traces` reads)")
    p.add_argument("--program", default=None, metavar="NAME",
                   help="with --script-from-trace: the program (default: the first)")
    return p


class ScriptOptionError(ValueError):
    """The script options cannot be used (the message says why)."""


def _find_program(trace: str, name: str | None) -> ProgramTrace:
    from mori.traces.loading import load_traces

    programs = load_traces(trace).programs
    if not programs:
        raise ScriptOptionError(f"{trace}: the trace holds no program")
    if name is None:
        return programs[0]
    for top in programs:
        for program in top.all_programs():
            if program.name == name:
                return program
    shown = ", ".join(p.name for p in programs[:5]) + (", ..." if len(programs) > 5 else "")
    raise ScriptOptionError(f"{trace}: no program named {name!r} (programs: {shown})")


def script_of(args: argparse.Namespace) -> Script | None:
    """The script the options name (None: none); ``ScriptError``, ``TraceError`` or
    ``ScriptOptionError`` saying what is wrong."""
    if args.program is not None and args.script_from_trace is None:
        raise ScriptOptionError("--program needs --script-from-trace")
    if args.script is not None:
        return load_script(args.script)
    if args.script_from_trace is not None:
        return script_from_trace(_find_program(args.script_from_trace, args.program))
    return None


def token_of(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The engine's token: ``--token``, else ``MORI_ENGINE_TOKEN`` (None: none);
    ``ScriptOptionError`` for one with whitespace."""
    token = args.token if args.token is not None else env.get(TOKEN_ENV) or None
    if token is not None and (not token.strip() or any(c.isspace() for c in token)):
        raise ScriptOptionError("--token must be non-empty and contain no whitespace")
    return token


async def _serve(args: argparse.Namespace, script: Script | None, token: str | None) -> None:
    from mori.enginesim import EngineSimConfig, start_engine_sim

    config = EngineSimConfig(
        preset=args.preset, time_scale=args.time_scale, cpu_ratio=args.cpu_ratio,
        typed_eviction=args.typed_eviction, gpu_kv_tokens=args.gpu_kv_tokens,
        model_name=args.model, max_queue=max(0, args.max_queue), script=script)
    running = await start_engine_sim(config, args.host, args.port, token=token)
    eng = running.engine
    cap = eng.capacity()
    print(f"mori engine-sim: {eng.model_name} on {args.preset} at {running.url} "
          f"(GPU KV {cap['gpu_tokens']:,} tokens, CPU KV {cap['cpu_tokens']:,} tokens, "
          f"time scale {args.time_scale:g}"
          + (f", a script of {len(script.steps)} steps" if script is not None else "")
          + (", token required" if token is not None else "")
          + "); Ctrl-C stops", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await running.stop()


def run_engine_sim(args: argparse.Namespace) -> int:
    """Serve until interrupted; the exit status (0; 2 for a script that cannot be used;
    1 when the port cannot be bound)."""
    try:
        script = script_of(args)
        token = token_of(args, os.environ)
    except (ScriptError, TraceError, ScriptOptionError) as e:
        print(f"mori engine-sim: error: {e}", file=sys.stderr)
        return 2
    try:
        run_loop(_serve(args, script, token))
    except OSError as e:  # the address cannot be used (the message names it)
        print(f"mori engine-sim: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
