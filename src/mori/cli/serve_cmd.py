"""``mori serve``: the live gateway, from flags and/or a TOML config file."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from types import FrameType
from typing import Any

from mori.cli.config_file import ConfigError, load_config, valid_keys
from mori.cli.eventloop import run_loop
from mori.cli.options import (
    POLICY_FIELDS,
    SERVE_BY_KEY,
    SERVE_OPTIONS,
    OptionError,
    add_options,
    policy_config,
)
from mori.core.costmodel import PRESETS
from mori.core.policy import PolicyConfig
from mori.core.registry import UnknownNameError
from mori.engines.registry import (
    ADAPTERS,
    BackendSpecError,
    parse_backend,
    shown,
    with_label_secret,
)
from mori.gateway.auth import KeyRing, check_exposure, read_key_file
from mori.gateway.config import GatewaySettings
from mori.gateway.record import check_record_file
from mori.gateway.server import ServeConfig, run_gateway
from mori.gateway.state import StateError, check_state_path
from mori.protocol.serve import bind_socket
from mori.sim.script import ScriptError, load_script
from mori.traces.errors import TraceError

_SERVE_FIELDS = frozenset(f.name for f in fields(ServeConfig)) - {"settings"}
"""The fields of ``ServeConfig`` options set directly; the rest are the gateway's."""

EPILOG = f"""\
backends:
  --backend KIND=URL[,key=value...], repeatable: one per engine replica. Kinds:
  {', '.join(ADAPTERS.names())}. Without --backend, --replicas simulated engines start in
  this process (the embedded default: no GPU, nothing to start by hand).

program ids:
  A request names its program by the body field "program_id" (with the openai client:
  extra_body={{"program_id": "..."}}) or the header X-Program-Id (UTF-8). An id is 1 to
  --max-program-id-bytes bytes, without control characters, and may not start with
  "anon-" (reserved). Unmodified agents are recognised by their own session ids
  (--program-id-from): Claude Code (X-Claude-Code-Session-Id, metadata.user_id), Codex
  (session-id / thread-id, x-codex-window-id), prompt_cache_key, X-Session-Id; each of
  their conversations (a subagent's, a compacted one) is a program of its own. A request
  none recognises is served as its own one-step program. POST /v1/programs/ID/release
  ends a program.

agents:
  Paths: /v1/chat/completions, /v1/completions, /v1/messages (Claude Code),
  /v1/messages/count_tokens, /v1/responses (Codex). Map the models agents ask for:
  --model-alias 'claude-*=SERVED'. Record their traffic as a trace: --record FILE.jsonl.gz.
  Claude Code: ANTHROPIC_BASE_URL=http://127.0.0.1:8000 claude

config file (--config FILE.toml):
{textwrap.fill("Keys are the long options, with dashes or underscores: "
                + ", ".join(valid_keys(SERVE_BY_KEY))
                + ' (backend = ["vllm=http://...", ...]). Flags given here win.',
                88, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)}

examples:
  mori serve
  mori serve --replicas 2 --time-scale 10 --port 8000
  mori serve --backend vllm=http://127.0.0.1:8001,kv_events=tcp://127.0.0.1:5557
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help lines wrapped at spaces only: names such as ``claude-code`` or
    ``--program-idle-timeout`` are never cut at their hyphens."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False,
                             break_long_words=False)


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible, program-aware gateway",
                       description="Run MORI's gateway in front of engine replicas (or of "
                       "simulated ones), scheduling KV residency with the chosen policy.",
                       epilog=EPILOG, formatter_class=_HelpFormatter)
    add_options(p, SERVE_OPTIONS)
    p.add_argument("--config", type=Path, metavar="FILE.toml", help="read options from a TOML "
                   "file; flags given here win")


class ServeUsageError(ValueError):
    pass


def gateway_settings(values: dict[str, Any], policy: PolicyConfig) -> GatewaySettings:
    """The gateway's settings: ``values`` by field name, the policy's knobs from ``policy``."""
    return GatewaySettings(**values, policy_config=policy)


def build_config(args: argparse.Namespace) -> ServeConfig:
    """The configuration of ``mori serve``: defaults, then the config file, then flags."""
    try:
        values: dict[str, Any] = (load_config(args.config, SERVE_BY_KEY)
                                  if args.config is not None else {})
    except ConfigError as e:
        raise ServeUsageError(str(e)) from None
    values.update({o.key: getattr(args, o.key) for o in SERVE_OPTIONS
                   if getattr(args, o.key) is not None})
    try:
        policy = policy_config(values, SERVE_BY_KEY)
    except OptionError as e:
        raise ServeUsageError(str(e)) from None
    by_field = {SERVE_BY_KEY[k].target: v for k, v in values.items()}
    serve = {f: v for f, v in by_field.items() if f in _SERVE_FIELDS}
    gateway = {f: v for f, v in by_field.items()
               if f not in _SERVE_FIELDS and f not in POLICY_FIELDS}
    try:
        settings = gateway_settings(gateway, policy)
    except ValueError as e:
        raise ServeUsageError(str(e)) from None
    serve["backends"] = list(serve.get("backends", ()))
    if serve.get("label_secret_file") is not None:
        try:
            serve["backends"] = [with_label_secret(b, str(serve["label_secret_file"]))
                                 for b in serve["backends"]]
        except BackendSpecError as e:
            raise ServeUsageError(str(e)) from None
    cfg = ServeConfig(settings=settings, **serve)
    try:
        cfg.settings = with_keys(cfg, os.environ)
        cfg.policy_connections = policy_connections(os.environ, cfg.policy_connections)
    except ValueError as e:
        raise ServeUsageError(str(e)) from None
    if cfg.preset not in PRESETS:
        raise ServeUsageError(f"unknown preset {cfg.preset!r}; valid: {', '.join(PRESETS.names())}")
    if cfg.replicas < 1:
        raise ServeUsageError(f"--replicas must be >= 1 (got {cfg.replicas})")
    if cfg.workers < 1:
        raise ServeUsageError(f"--workers must be >= 1 (got {cfg.workers})")
    if cfg.workers > 1 and any("attribution=tokens" in b for b in cfg.backends):
        raise ServeUsageError("--workers > 1 cannot attribute KV by tokens (the workers "
                              "forward, the policy process keeps the index): use "
                              "attribution=session or salt, or --workers 1")
    if not 0 <= cfg.port < 65536:
        raise ServeUsageError(f"--port must be in 0..65535 (got {cfg.port})")
    if cfg.cpu_ratio < 0:
        raise ServeUsageError(f"--cpu-ratio must be >= 0 (got {cfg.cpu_ratio})")
    if cfg.gpu_kv_tokens is not None and cfg.gpu_kv_tokens < 1:
        raise ServeUsageError(f"--gpu-kv-tokens must be >= 1 (got {cfg.gpu_kv_tokens})")
    for b in cfg.backends:
        try:
            parse_backend(b).build()
        except (ValueError, UnknownNameError, TypeError) as e:  # BackendSpecError, secrets
            raise ServeUsageError(str(e)) from None
    try:
        check_exposure(cfg.host, KeyRing(cfg.settings.api_keys, cfg.settings.admin_keys),
                       cfg.allow_unauthenticated)
    except ValueError as e:
        raise ServeUsageError(str(e)) from None
    check_files(cfg)
    return cfg


def check_files(cfg: ServeConfig) -> None:
    """Refuse, before anything starts, an engine script that cannot be read and a record
    file that is not a MORI trace (``ServeUsageError`` naming the file and the fault)."""
    if cfg.engine_script is not None:
        if cfg.backends:
            raise ServeUsageError("--engine-script scripts the simulated engines; it cannot "
                                  "be used with --backend")
        try:
            load_script(cfg.engine_script)
        except ScriptError as e:
            raise ServeUsageError(f"--engine-script: {e}") from None
    if cfg.settings.record is not None:
        try:
            check_record_file(cfg.settings.record)
        except TraceError as e:
            raise ServeUsageError(f"--record: {e}") from None
    if cfg.settings.state is not None:
        try:
            check_state_path(cfg.settings.state)
        except StateError as e:
            raise ServeUsageError(f"--state: {e}") from None


def with_keys(cfg: ServeConfig, env: Mapping[str, str]) -> GatewaySettings:
    """The settings with every configured key: flags and config file, key files, and
    the environment (``MORI_API_KEYS``, ``MORI_ADMIN_KEYS``: separated by commas or
    whitespace). ``ValueError`` for an unreadable key file or a malformed key."""
    s = cfg.settings
    api, admin = list(s.api_keys), list(s.admin_keys)
    if cfg.api_key_file is not None:
        api += read_key_file(cfg.api_key_file)
    if cfg.admin_key_file is not None:
        admin += read_key_file(cfg.admin_key_file)
    api += env.get("MORI_API_KEYS", "").replace(",", " ").split()
    admin += env.get("MORI_ADMIN_KEYS", "").replace(",", " ").split()
    KeyRing(tuple(api), tuple(admin))  # checks each key
    return dataclasses.replace(s, api_keys=tuple(dict.fromkeys(api)),
                               admin_keys=tuple(dict.fromkeys(admin)))


POLICY_CONNECTIONS_ENV = "MORI_POLICY_CONNECTIONS"
"""With ``--workers`` > 1: how many connections the policy process serves itself before
it hands new ones to the workers (default 2). ``0`` puts every connection on a worker,
which is how the tests run the agents and the APIs through workers."""


def policy_connections(env: Mapping[str, str], default: int) -> int:
    """``MORI_POLICY_CONNECTIONS`` from ``env`` (``default`` if unset); ``ValueError``
    for anything but an integer >= 0."""
    raw = env.get(POLICY_CONNECTIONS_ENV, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{POLICY_CONNECTIONS_ENV} must be an integer >= 0 (got {raw!r}): "
                         "the connections the policy process serves itself with --workers")
    return int(raw)


def terminate_as_interrupt() -> None:
    """Make SIGTERM stop the gateway as Ctrl-C (SIGINT) does. uvicorn shuts down
    gracefully on either, then raises the signal again for the handler it found: for
    SIGINT, the event loop runner's, which cancels the gateway's task so that its own
    clean-up runs (workers stopped, the temp folder removed); SIGTERM's default action
    would end the process there and skip it. So SIGTERM calls SIGINT's handler of the
    moment."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


class EmbeddedServerFilter(logging.Filter):
    """Drops what the embedded engines' uvicorn servers log below WARNING.

    uvicorn logs every server's start and shutdown on the one ``uvicorn.error`` logger,
    at the level of the last server configured (the gateway's ``--log-level``), so each
    simulated engine would repeat the gateway's "Shutting down" lines. Those servers run
    in tasks ``mori.protocol.serve.serve_app`` names ``uvicorn:PORT``; the gateway's is
    not one of them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running loop
            return True
        return task is None or not task.get_name().startswith("uvicorn:")


def _quiet_embedded_servers() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, EmbeddedServerFilter) for f in logger.filters):
        logger.addFilter(EmbeddedServerFilter())


def check_address(cfg: ServeConfig) -> None:
    """Raise ``OSError`` now, before any engine starts, if the gateway cannot listen on
    ``cfg.host:cfg.port`` (port 0 always can)."""
    if cfg.port != 0:
        bind_socket(cfg.host, cfg.port).close()


def run_serve(args: argparse.Namespace) -> int:
    try:
        cfg = build_config(args)
    except ServeUsageError as e:
        print(f"mori serve: error: {e}", file=sys.stderr)
        return 2
    try:
        check_address(cfg)
    except OSError as e:
        print(f"mori serve: error: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet_embedded_servers()

    def ready(url: str) -> None:
        where = (", ".join(map(shown, cfg.backends)) if cfg.backends
                 else f"{cfg.replicas} simulated {cfg.preset} replica(s)")
        print(f"mori serve: listening on {url} (policy {cfg.settings.policy}, {where})",
              flush=True)

    terminate_as_interrupt()
    try:
        run_loop(run_gateway(cfg, ready))
    except KeyboardInterrupt:
        return 0
    except (OSError, RuntimeError) as e:
        print(f"mori serve: error: {e}", file=sys.stderr)
        return 1
    return 0

