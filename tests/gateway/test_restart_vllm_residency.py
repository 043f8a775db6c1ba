"""A restarted gateway in front of vLLM engines with MORI's plug-in finds every program
where its KV is: the plug-in answers ``residency`` from its own tables (the KV events
only tell what happened since the gateway started). Two vLLM adapters, each on a fake
vLLM HTTP server and a fake plug-in (``support.fake_plugin``) that holds a residency."""

from __future__ import annotations

from pathlib import Path

import httpx

from mori.engines.vllm import VLLMAdapter
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from support.fake_engine import FakeEngine
from support.fake_plugin import FakePlugin
from support.loop_thread import LoopThread

METRICS = (Path(__file__).resolve().parents[1] / "data" / "vllm" / "metrics_idle.txt"
           ).read_text()  # 64 GPU blocks x 32 tokens
ROUTES = {"GET /metrics": METRICS, "GET /health": "",
          "GET /v1/models": {"object": "list", "data": [{"id": "tiny"}]}}
HELD = [
    # engine 0: a and b on its GPU, c only in its CPU tier, d released before the restart
    {"gpu": {"a": 640, "b": 320, "d": 64}, "cpu": {"c": 256}, "inactive": ["d"]},
    # engine 1: e on its GPU; b in its CPU tier too (the GPU copy on engine 0 wins)
    {"gpu": {"e": 128}, "cpu": {"b": 320}, "inactive": []},
]


def test_a_restarted_gateway_takes_every_program_back_from_the_plugins(
        loop_thread: LoopThread) -> None:
    lt = loop_thread
    urls, plugins = [], []
    for held in HELD:
        eng = FakeEngine(routes=ROUTES)
        lt.handles.append(eng)
        lt.call(eng.start())
        plug = FakePlugin(residency=held, cpu_tier_tokens=8192)  # a host tier
        lt.call(plug.start())
        urls.append(eng.url)
        plugins.append(plug)
    try:
        adapters = [VLLMAdapter(u, labels=p.endpoint, labels_check_s=60.0)
                    for u, p in zip(urls, plugins, strict=True)]
        gw = lt.serve(create_app(GatewaySettings(policy="mori"), adapters)).url
        where = {}
        for pid in "abce":
            r = httpx.get(f"{gw}/v1/programs/{pid}", timeout=10)
            assert r.status_code == 200, (pid, r.text)
            where[pid] = (r.json()["replica"], r.json()["tier"])
        assert {p: w[0] for p, w in where.items()} == {"a": 0, "b": 0, "c": 0, "e": 1}
        assert where["a"][1] == where["b"][1] == where["e"][1] == "gpu"
        assert where["c"][1] == "cpu"  # its KV is in the host tier
        # released before the restart: not taken back as a live program
        assert httpx.get(f"{gw}/v1/programs/d", timeout=10).status_code == 404
        assert all("residency" in p.ops for p in plugins)
    finally:
        for p in plugins:
            lt.call(p.stop())
            p.close()
