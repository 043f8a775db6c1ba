"""Shared by the engine-sim tests (``tests/enginesim``): a fresh simulated engine served
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
import anthropic
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


@contextlib.asynccontextmanager
async def anthropic_client(srv: EngineSimServer, headers: dict[str, str] | None = None
                           ) -> AsyncIterator[anthropic.AsyncAnthropic]:
    c = anthropic.AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                 default_headers=headers)
    try:
        yield c
    finally:
        await c.close()


async def sse_events(srv: EngineSimServer, path: str, body: Any
                     ) -> tuple[str, list[tuple[str | None, Any]]]:
    """POST a streaming request; its raw text and its events as (event name, data)."""
    async with aiohttp.ClientSession() as s, s.post(srv.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        text = await r.text()
    events: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln and not ln.startswith(":")]
        if not lines:
            continue
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = next(ln[6:] for ln in lines if ln.startswith("data: "))
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return text, events


async def http(srv: EngineSimServer, method: str, path: str,
               body: Any = None, raw: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.request(
            method, srv.url + path, json=body if raw is None else None, data=raw,
            headers={"content-type": "application/json", **(headers or {})}) as r:
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
