"""``mori serve`` in front of one scripted simulated engine, for tests that send requests
shaped as an agent sends them (headers and bodies as seen on the wire): served by the
policy process or, ``via="workers"``, by a worker process (``through_workers``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from gateway_harness import LoopThread
from through_workers import WorkersGateway, workers_config

from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig, start_simulated_backends


def start_scripted(lt: LoopThread, tmp: Path, via: str, script: dict[str, Any],
                   **settings: Any) -> tuple[str, str]:
    """The gateway's URL and the served model name."""
    path = tmp / "script.json"
    path.write_text(json.dumps(script))
    s = GatewaySettings(**settings)
    engines = {"replicas": 1, "preset": "h200-qwen3-30b-a3b", "cpu_ratio": 0.5,
               "gpu_kv_tokens": 200_000, "engine_script": path}
    if via == "workers":
        url = WorkersGateway(lt, workers_config(settings=s, **engines)).url
    else:
        cfg = ServeConfig(settings=s, **engines)  # type: ignore[arg-type]
        adapters, handles = lt.call(start_simulated_backends(cfg))
        lt.handles.extend(handles)
        url = lt.serve(create_app(s, adapters)).url
    model: str = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    return url, model


def programs(url: str) -> dict[str, dict[str, Any]]:
    """``/v1/programs``, by program id."""
    rows = httpx.get(url + "/v1/programs").json()["data"]
    return {r["program_id"]: r for r in rows}
