"""``mori serve``: the live gateway, from flags and/or a TOML config file."""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any

from mori.cli.eventloop import run_loop
from mori.core.costmodel import PRESETS
from mori.core.registry import UnknownNameError
from mori.engines.registry import ADAPTERS, BackendSpecError, parse_backend
from mori.gateway.app import GatewaySettings
from mori.gateway.server import ServeConfig, run_gateway

# (flag, key, type, help); the key is the config-file key and the field it sets
_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--host", "host", str, "address to listen on (default 127.0.0.1)"),
    ("--port", "port", int, "port to listen on; 0 picks a free one (default 8000)"),
    ("--replicas", "replicas", int, "simulated engine replicas to start when no --backend is "
     "given (default 1)"),
    ("--preset", "preset", str, "hardware preset of the simulated engines (default "
     "h200-qwen3-30b-a3b; see `mori presets`)"),
    ("--cpu-ratio", "cpu_ratio", float, "CPU KV tier of the simulated engines, x the GPU pool, "
     "for policies whose engine has one (default 1)"),
    ("--gpu-kv-tokens", "gpu_kv_tokens", int, "shrink the simulated engines' GPU KV pool to "
     "this many tokens (default: the preset's)"),
    ("--policy", "policy", str, "scheduling policy (default mori; see `mori policies`)"),
    ("--tick", "tick_s", float, "policy tick in seconds of policy time (default 5)"),
    ("--idleness-window", "idleness_window", int, "idleness window k in cycles (default 5)"),
    ("--binary-threshold", "binary_threshold", float, "threshold of mori-binary (default 0.5)"),
    ("--time-scale", "time_scale", float, "policy and simulated-engine seconds per wall second "
     "(default 1; > 1 runs traces faster than real time)"),
    ("--max-gated", "max_gated", int, "requests that may wait for GPU residency at once; more "
     "get 429 (default 1024)"),
    ("--gate-timeout", "gate_timeout_s", float, "seconds a request may wait for GPU residency "
     "before a 503 with Retry-After (default 300)"),
    ("--retry-after", "retry_after_s", float, "Retry-After seconds on 429/503 (default 5)"),
    ("--program-ttl", "program_ttl_s", float, "release a program idle this many wall seconds "
     "without a request; 0 never (default 3600)"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body accepted; larger gets "
     "413 (default 33554432)"),
    ("--health-interval", "health_interval_s", float, "seconds between health checks of an "
     "unhealthy replica (default 2)"),
    ("--startup-wait", "startup_wait_s", float, "seconds to wait for engines that are still "
     "starting before giving up (default 60)"),
    ("--log-level", "log_level", str, "debug, info, warning or error (default info)"),
]
_BOOL_FLAGS = [("--exact-tokens", "exact_tokens", "count prompt tokens with the engine's "
                "tokenizer where it offers one (one more round trip per request) instead of "
                "estimating 4 characters per token")]

EPILOG = f"""\
backends:
  --backend KIND=URL[,key=value...], repeatable: one per engine replica. Kinds:
  {', '.join(ADAPTERS.names())}. Without --backend, --replicas simulated engines start in
  this process (the embedded default: no GPU, nothing to start by hand).

program ids:
  A request names its program by the body field "program_id" (with the openai client:
  extra_body={{"program_id": "..."}}) or the header X-Program-Id. A request with neither
  is served as its own one-step program. POST /v1/programs/ID/release ends a program.

config file (--config FILE.toml):
{textwrap.fill("Keys are the long options, with dashes or underscores: "
                + ", ".join(f[2:] for f, _, _, _ in _FLAGS)
                + ', exact-tokens, backend = ["vllm=http://...", ...]. Flags given here win.',
                88, initial_indent="  ", subsequent_indent="  ")}

examples:
  mori serve
  mori serve --replicas 2 --time-scale 10 --port 8000
  mori serve --backend vllm=http://127.0.0.1:8001,kv_events=tcp://127.0.0.1:5557
"""


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible, program-aware gateway",
                       description="Run MORI's gateway in front of engine replicas (or of "
                       "simulated ones), scheduling KV residency with the chosen policy.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", action="append", dest="backend", metavar="KIND=URL[,k=v...]",
                   help="an engine replica (repeatable)")
    for flag, key, typ, hlp in _FLAGS:
        metavar = {int: "N", float: "X", str: "NAME"}[typ]
        p.add_argument(flag, dest=key, type=typ, default=None, help=hlp, metavar=metavar)
    for flag, key, hlp in _BOOL_FLAGS:
        p.add_argument(flag, dest=key, action="store_true", default=None, help=hlp)
    p.add_argument("--config", type=Path, metavar="FILE.toml", help="read options from a TOML "
                   "file; flags given here win")


class ServeUsageError(ValueError):
    pass


def _load_toml(path: Path) -> dict[str, Any]:
    import tomllib
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ServeUsageError(f"config file {str(path)!r}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ServeUsageError(f"config file {str(path)!r}: not valid TOML: {e}") from None
    # a key is a long option's name (dashes or underscores): the field it sets, its type
    valid = {flag[2:].replace("-", "_"): (k, typ) for flag, k, typ, _ in _FLAGS}
    valid |= {flag[2:].replace("-", "_"): (k, bool) for flag, k, _ in _BOOL_FLAGS}
    valid["backend"] = ("backend", list)
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name.replace("-", "_") not in valid:
            raise ServeUsageError(
                f"config file {str(path)!r}: unknown key {name!r}; valid keys: "
                f"{', '.join(sorted(k.replace('_', '-') for k in valid))}")
        key, typ = valid[name.replace("-", "_")]
        if key == "backend":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ServeUsageError(f"config file {str(path)!r}: 'backend' must be a string "
                                      "or an array of strings")
        elif typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        elif not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ServeUsageError(f"config file {str(path)!r}: key {name!r} must be of type "
                                  f"{typ.__name__} (got {value!r})")
        out[key] = value
    return out


def build_config(args: argparse.Namespace) -> ServeConfig:
    values: dict[str, Any] = _load_toml(args.config) if args.config is not None else {}
    for _, key, _, _ in _FLAGS:
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    for _, key, _ in _BOOL_FLAGS:
        if getattr(args, key):
            values[key] = True
    if args.backend:
        values["backend"] = args.backend
    setting_keys = {f.name for f in fields(GatewaySettings)}
    try:
        settings = GatewaySettings(**{k: v for k, v in values.items() if k in setting_keys})
    except ValueError as e:
        raise ServeUsageError(str(e)) from None
    serve_keys = {f.name for f in fields(ServeConfig)} - {"settings", "backends"}
    cfg = ServeConfig(settings=settings, backends=list(values.get("backend", [])),
                      **{k: v for k, v in values.items() if k in serve_keys})
    if cfg.preset not in PRESETS:
        raise ServeUsageError(f"unknown preset {cfg.preset!r}; valid: {', '.join(PRESETS.names())}")
    if cfg.replicas < 1:
        raise ServeUsageError(f"--replicas must be >= 1 (got {cfg.replicas})")
    if not 0 <= cfg.port < 65536:
        raise ServeUsageError(f"--port must be in 0..65535 (got {cfg.port})")
    if cfg.cpu_ratio < 0:
        raise ServeUsageError(f"--cpu-ratio must be >= 0 (got {cfg.cpu_ratio})")
    if cfg.gpu_kv_tokens is not None and cfg.gpu_kv_tokens < 1:
        raise ServeUsageError(f"--gpu-kv-tokens must be >= 1 (got {cfg.gpu_kv_tokens})")
    if cfg.log_level not in ("debug", "info", "warning", "error"):
        raise ServeUsageError(f"--log-level must be debug, info, warning or error "
                              f"(got {cfg.log_level!r})")
    for b in cfg.backends:
        try:
            parse_backend(b).build()
        except (BackendSpecError, UnknownNameError, TypeError) as e:
            raise ServeUsageError(str(e)) from None
    return cfg


def run_serve(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(args)
    except ServeUsageError as e:
        print(f"mori serve: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(url: str) -> None:
        where = (", ".join(cfg.backends) if cfg.backends
                 else f"{cfg.replicas} simulated {cfg.preset} replica(s)")
        print(f"mori serve: listening on {url} (policy {cfg.settings.policy}, {where})",
              flush=True)

    try:
        run_loop(run_gateway(cfg, ready))
    except KeyboardInterrupt:
        return 0
    except (OSError, RuntimeError) as e:
        print(f"mori serve: error: {e}", file=sys.stderr)
        return 1
    return 0

