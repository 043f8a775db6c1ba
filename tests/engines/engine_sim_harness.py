"""Shared by the engine-sim tests (``test_engine_sim_*``): a fresh simulated engine served
in-process on a free port, time-scaled so that each test takes well under a second of
wall time, and the clients that talk to it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
import openai

from mori.core.costmodel import get_preset
from mori.enginesim import EngineSimConfig, EngineSimServer, start_engine_sim

PRESET = "h200-qwen3-30b-a3b"
MODEL = get_preset(PRESET).model.name
PAGE = get_preset(PRESET).page_tokens
T = TypeVar("T")


def run(fn: Callable[..., Awaitable[T]], **config: Any) -> T:
    """Run ``fn(server)`` against a fresh engine-sim (time scale 1000 unless given)."""

    async def main() -> T:
        cfg = EngineSimConfig(PRESET, **{"time_scale": 1000.0, **config})
        srv = await start_engine_sim(cfg)
        try:
            return await asyncio.wait_for(fn(srv), 15)
        finally:
            await srv.stop()

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def client(srv: EngineSimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    try:
        yield c
    finally:
        await c.close()


async def http(srv: EngineSimServer, method: str, path: str,
               body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(
            method, srv.url + path, json=body if raw is None else None, data=raw,
            headers={"content-type": "application/json"}) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text


def synthetic(prompt: int, reuse: int | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"prompt_tokens": prompt}
    if reuse is not None:
        m["reuse_tokens"] = reuse
    return {"mori": m}


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)
