"""Aborts and the simulated engine's lifetime (``mori.enginesim``): a client that leaves
mid-stream frees its request, the model aborts a request in each phase, and the command
line serves until interrupted and stops its streams promptly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from mori.core.costmodel import CostModel, get_preset
from mori.enginesim import EngineSimConfig, EngineSimServer, start_engine_sim
from mori.sim.clock import EventLoop
from mori.sim.kvcache import KVPools
from mori.sim.replica_model import EngineReplica, SimRequest

from .harness import MODEL, PAGE, PRESET, client, run, synthetic, wait_until

# -- aborts ---------------------------------------------------------------------------------

def test_disconnect_mid_stream_aborts_and_frees() -> None:
    async def go(srv: EngineSimServer) -> None:
        eng = srv.engine
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 100_000, "stream": True, "program_id": "p", **synthetic(3000)}
        async with aiohttp.ClientSession() as s:
            r = await s.post(srv.url + "/v1/chat/completions", json=body)
            assert r.status == 200
            seen = b""
            while seen.count(b"data: ") < 3:
                seen += await r.content.readany()
            assert eng.running == 1
            r.close()  # the client goes away
        await wait_until(lambda: eng.counters.aborted == 1)
        eng.sync()
        assert eng.running == 0 and not eng.replica.decode
        e = eng.pools.entries["p"]
        assert not e.pinned
        assert e.gpu * PAGE < 3000 + 100_000  # the output reservation is freed
        assert e.gpu * PAGE >= 3000 // PAGE * PAGE  # what was computed stays
        eng.pools.check()
        # a non-streaming request whose client gives up is aborted as well
        body = {**body, "stream": False, "program_id": "q"}
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                await s.post(srv.url + "/v1/chat/completions", json=body,
                             timeout=aiohttp.ClientTimeout(total=0.3))
        await wait_until(lambda: eng.counters.aborted == 2)
        assert eng.running == 0 and eng.waiting == 0
        # the engine still serves
        async with client(srv) as c:
            done = await c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert done.usage is not None and done.usage.completion_tokens == 2

    run(go, time_scale=20.0)



# -- the model's abort, directly ------------------------------------------------------------

class _Quiet:
    def __init__(self) -> None:
        self.done: list[str] = []

    def kv_ready(self, req: SimRequest, now: float) -> None: ...
    def first_token(self, req: SimRequest, now: float) -> None: ...
    def produced(self, tokens: int, now: float) -> None: ...

    def finished(self, req: SimRequest, now: float) -> None:
        self.done.append(req.program_id)


@pytest.mark.parametrize("when", ["waiting", "prefill", "decode", "loading"])
def test_replica_abort_in_each_phase(when: str) -> None:
    cost = CostModel(get_preset(PRESET))
    loop = EventLoop()
    rec = _Quiet()
    eng = EngineReplica(0, cost, loop, KVPools(400, 400, False), rec, False)
    if when == "loading":  # x's KV sits on the CPU: its next request reloads it first
        eng.submit(SimRequest("x", 6400, 0, 1, 0.0))
        loop.run(10.0)
        eng.evict("x")
        rec.done.clear()
        t = loop.now
    else:
        t = 0.0
    blocker = SimRequest("big", 20_000, 0, 1, t) if when == "waiting" else None
    if blocker is not None:  # holds the pool so that x waits
        eng.submit(blocker)
        blocker2 = SimRequest("big2", 4_000, 0, 5, t)
        eng.submit(blocker2)
    x = SimRequest("x", 12_800, 6400 if when == "loading" else 0, 500, t)
    other = SimRequest("o", 1000, 0, 300, t)
    eng.submit(x)
    eng.submit(other)
    if when == "prefill":
        loop.run(t + 1e-3)
        assert x in eng.prefill
    elif when == "decode":
        while x.first_token_at is None:
            loop.run(loop.now + 0.01)
        assert x in eng.decode
    elif when == "loading":
        assert eng.loading == 1
    else:
        assert x in eng.waiting
    assert eng.abort(x)
    assert not eng.abort(x)
    loop.run(t + 100.0)
    assert "x" not in rec.done and "o" in rec.done
    assert eng.running == 0 and not eng.waiting
    assert not eng.pools.entries["x"].pinned if "x" in eng.pools.entries else True
    eng.pools.check()


# -- the command line -----------------------------------------------------------------------

def test_cli_serves_until_interrupted() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = ("import argparse, sys; from mori.cli.engine_sim_cmd import add_engine_sim_parser, "
            "run_engine_sim; p = argparse.ArgumentParser(); s = p.add_subparsers(dest='c'); "
            "add_engine_sim_parser(s); sys.exit(run_engine_sim(p.parse_args(sys.argv[1:])))")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "engine-sim", "--preset", PRESET, "--port", "0",
         "--time-scale", "1000", "--gpu-kv-tokens", "65536", "--model", "m1"],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "http://127.0.0.1:" in line, line
        url = line.split(" at ")[1].split()[0]

        async def ask() -> None:
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            r = await c.chat.completions.create(
                model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
            assert r.usage is not None and r.usage.completion_tokens == 3
            await c.close()
            async with aiohttp.ClientSession() as s, s.get(url + "/mori/v1/capacity") as r2:
                assert (await r2.json())["gpu_tokens"] == 65536

        asyncio.run(ask())
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_ends_streams_promptly() -> None:
    async def go() -> None:
        srv = await start_engine_sim(EngineSimConfig(PRESET, time_scale=1.0))
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000,
                "stream": True}
        async with aiohttp.ClientSession() as s:
            r = await s.post(srv.url + "/v1/chat/completions", json=body)
            seen = b""
            while b"data: " not in seen:
                seen += await r.content.readany()
            t0 = time.monotonic()
            await srv.stop()
            assert time.monotonic() - t0 < 1.5
            seen += await r.content.read()
        assert b'"code": "aborted"' in seen and b"[DONE]" not in seen
        assert srv.engine.counters.aborted == 1 and srv.engine.running == 0

    asyncio.run(asyncio.wait_for(go(), 10))
