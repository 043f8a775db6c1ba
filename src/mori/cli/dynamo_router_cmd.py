"""``mori dynamo-router``: MORI's control loop as a router service inside NVIDIA Dynamo."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TypeVar

from mori.core.policies import POLICIES
from mori.gateway.config import GatewaySettings

_GW = GatewaySettings()

EPILOG = """\
Runs in Dynamo's Python environment (Dynamo is imported only by this command):
  scripts/dynamo_cpu_env.sh builds one on a CPU machine; with a GPU, pip install
  ai-dynamo there and this repository (pip install -e .) beside it.

It serves {namespace}.mori_router.generate and registers it as --model-name, so
Dynamo's frontend sends it every tokenized request of that model. Each request's
agent_context (the frontend fills it from x-dynamo-session-id,
x-dynamo-parent-session-id, x-dynamo-session-final) names its program; the gap
between a program's requests is its tool time. MORI admits each turn, holds the
turns of programs it keeps off the GPU, pins each program to the worker it
placed it on (routing.backend_instance_id) and moves a held turn up the engine's
queue by the time it waited (routing.priority_jump). session_final releases the
program. Register the workers under another model name (or --endpoint-types none)
so the frontend cannot send around the router.

The discovery backend and request plane come from Dynamo's environment
(DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE, ...), as for every Dynamo process.

example (CPU, Dynamo's mocker engine; docs/dynamo.md has the whole fleet):
  PYTHONPATH=src $VENV/bin/python -m mori dynamo-router --endpoint dynamo.backend.generate \\
      --model-name agent --model-path ~/.cache/mori/tiny-llama --workers 2
"""


P = TypeVar("P", bound=argparse.ArgumentParser)


def add_dynamo_router_parser(sub: argparse._SubParsersAction[P]) -> P:
    """Add the ``dynamo-router`` subcommand to ``sub``; returns its parser."""
    p = sub.add_parser(
        "dynamo-router", help="run MORI as a router service inside NVIDIA Dynamo",
        description="Schedule agentic programs on Dynamo's workers with MORI's policy: "
        "rank by idleness, hold the idle ones' turns, pin each program to its worker.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="dynamo.backend.generate",
                   help="the workers' Dynamo endpoint, namespace.component.endpoint "
                        "(default: %(default)s)")
    p.add_argument("--model-name", required=True,
                   help="the public model name the router registers (clients ask for it)")
    p.add_argument("--model-path", required=True,
                   help="the model's folder or Hugging Face id (its tokenizer and chat "
                        "template, for the frontend)")
    p.add_argument("--workers", type=int, default=0,
                   help="MORI's replica slots, one per worker (0: as many workers as are "
                        "up at start; default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16,
                   help="the workers' KV block size in tokens (default: %(default)s)")
    p.add_argument("--host-tokens", type=int, default=None,
                   help="each worker's host KV tier in tokens, where its model card does "
                        "not say (default: the card's, else none)")
    p.add_argument("--policy", default=_GW.policy, choices=POLICIES.names(),
                   help="the scheduling policy (default: %(default)s)")
    p.add_argument("--hold-timeout", type=float, default=_GW.hold_timeout_s,
                   help="the longest a turn is held, seconds (then 503; default: "
                        "%(default)g)")
    p.add_argument("--max-held", type=int, default=_GW.max_held,
                   help="the most turns held at once (then 429; default: %(default)s)")
    p.add_argument("--program-ttl", type=float, default=_GW.program_ttl_s,
                   help="a program idle this long is released, seconds (0: only by "
                        "session_final; default: %(default)g)")
    p.add_argument("--startup-wait", type=float, default=120.0,
                   help="how long to wait for the workers, seconds (default: %(default)g)")
    p.add_argument("--log-level", default="INFO",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="the router's log level (default: %(default)s)")
    return p


def run_dynamo_router(args: argparse.Namespace) -> int:
    from mori.dynamo.router import RouterConfig, run

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s "
                        "%(message)s", stream=sys.stderr)
    try:
        settings = GatewaySettings(policy=args.policy, hold_timeout_s=args.hold_timeout,
                                   max_held=args.max_held, program_ttl_s=args.program_ttl,
                                   health_interval_s=0.5)
        config = RouterConfig(endpoint=args.endpoint, model_name=args.model_name,
                              model_path=args.model_path, settings=settings,
                              workers=args.workers, block_size=args.block_size,
                              host_tokens=args.host_tokens, startup_wait_s=args.startup_wait)
        config.check()
        return run(config)
    except (ValueError, RuntimeError) as e:
        print(f"mori dynamo-router: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
