"""The gateway tests' harness: servers run on an event loop in a background thread, tests
use the official (synchronous) ``openai`` client and plain HTTP from the test thread.

The pieces are shared with the other test directories (``tests/support``): the loop
thread, the fake engine, and ``Running``, a served app (``mori.protocol.serve``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mori.engines.base import EngineAdapter
from mori.gateway.app import Gateway, create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig, start_simulated_backends
from mori.protocol.serve import RunningServer as Running
from support.fake_engine import FakeEngine
from support.loop_thread import LoopThread

BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}
"""Claude Code's shell tool, as a Messages request offers it."""
SHELL = {"type": "function", "name": "shell", "description": "Run a command",
         "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}}}}}
"""Codex's shell tool, as a Responses request offers it."""

__all__ = ["FakeEngine", "LoopThread", "Running", "SimGateway", "serve_on_simulated"]


@dataclass(frozen=True)
class SimGateway:
    """A gateway app served on ``lt`` in front of simulated engines started there."""

    url: str
    gw: Gateway
    adapters: list[EngineAdapter]
    engines: list[Any]  # the simulated engines' servers (``EngineSimServer``)


def serve_on_simulated(lt: LoopThread, settings: GatewaySettings, replicas: int = 1,
                       gpu_kv_tokens: int = 200_000) -> SimGateway:
    """Start ``replicas`` simulated engines (h200-qwen3-30b-a3b, a CPU tier of half the
    GPU pool) and the gateway with ``settings`` in front of them, on ``lt``."""
    cfg = ServeConfig(replicas=replicas, preset="h200-qwen3-30b-a3b", cpu_ratio=0.5,
                      gpu_kv_tokens=gpu_kv_tokens, settings=settings)
    adapters, handles = lt.call(start_simulated_backends(cfg))
    lt.handles.extend(handles)
    app = create_app(settings, adapters)
    return SimGateway(lt.serve(app).url, app.state.gateway, adapters, handles)
