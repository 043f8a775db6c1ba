"""``SimEngineAdapter`` against a real engine-sim served in-process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from mori.core.costmodel import get_preset
from mori.core.types import KVLabel
from mori.engines.base import Capability, RequestHints, UpstreamError
from mori.engines.registry import ADAPTERS, parse_backend
from mori.engines.simulated import SimEngineAdapter
from mori.enginesim import EngineSimConfig, EngineSimServer, start_engine_sim

PRESET = "h200-80g-qwen2.5-7b"
MODEL = get_preset(PRESET).model.name
PAGE = get_preset(PRESET).page_tokens


def run(fn: Callable[[EngineSimServer, SimEngineAdapter], Awaitable[None]],
        **config: Any) -> None:
    async def main() -> None:
        srv = await start_engine_sim(EngineSimConfig(PRESET, **{"time_scale": 1000.0,
                                                                **config}))
        adapter = SimEngineAdapter(srv.url)
        await adapter.start()
        try:
            await asyncio.wait_for(fn(srv, adapter), 15)
        finally:
            await adapter.close()
            await srv.stop()

    asyncio.run(main())


def sse_events(raw: bytes) -> list[Any]:
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_registered_and_declared() -> None:
    assert ADAPTERS.get("sim") is SimEngineAdapter
    assert isinstance(parse_backend("sim=http://127.0.0.1:9").build(), SimEngineAdapter)
    adapter = SimEngineAdapter("http://127.0.0.1:9")
    for cap in (Capability.LABELS, Capability.OFFLOAD, Capability.DROP, Capability.RESIDENCY,
                Capability.SYNTHETIC_PROMPTS, Capability.TOKENIZE, Capability.PRIORITY):
        assert adapter.capabilities >= {cap}
    assert Capability.PREFETCH not in adapter.capabilities


def test_forward_and_controls_round_trip() -> None:
    async def go(srv: EngineSimServer, a: SimEngineAdapter) -> None:
        assert await a.health()
        assert [m["id"] for m in await a.models()] == [MODEL]
        cap = await a.capacity()
        assert (cap.gpu_tokens, cap.cpu_tokens, cap.page_tokens) == (65536, 32768, PAGE)
        preset = get_preset(PRESET)
        assert cap.kv_bytes_per_token == preset.kv_bytes_per_token_per_gpu * preset.tp

        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 5}
        hints = RequestHints("prog", priority=2, synthetic={"prompt_tokens": 3000})
        assert await a.count_prompt_tokens("/v1/chat/completions", body) == 2
        assert await a.count_prompt_tokens(
            "/v1/chat/completions", {**body, "mori": {"prompt_tokens": 3000}}) == 3000
        resp = await a.forward("/v1/chat/completions", body, False, hints)
        assert resp.status == 200 and resp.body is not None
        data = json.loads(resp.body)
        assert data["usage"]["prompt_tokens"] == 3000  # the synthetic size was sent
        assert len(data["choices"][0]["message"]["content"].split()) == 5
        res = await a.residency()
        assert res.gpu_tokens == {"prog": 3005 // PAGE * PAGE}  # its whole pages

        # streaming: the next step of the same program reuses its context
        hints2 = RequestHints("prog", synthetic={"prompt_tokens": 3200})
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        resp = await a.forward("/v1/chat/completions", stream_body, True, hints2)
        assert resp.status == 200 and resp.chunks is not None
        raw = b"".join([c async for c in resp.chunks])
        await resp.aclose()
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "")
                       for e in events[:-1] if e["choices"])
        assert len(text.split()) == 5
        usage = events[-2]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3005 // PAGE * PAGE

        await a.set_label("prog", KVLabel.IDLE)
        assert srv.engine.pools.entries["prog"].label is KVLabel.IDLE
        await a.offload("prog")
        res = await a.residency()
        assert "prog" not in res.gpu_tokens and res.cpu_tokens["prog"] > 0
        await a.drop("prog")
        res = await a.residency()
        assert dict(res.gpu_tokens) == {} and dict(res.cpu_tokens) == {}
        await a.offload("never-seen")  # nothing held: nothing to do
        await a.drop("never-seen")
        await a.release("prog")
        await a.set_label("a/b #1", KVLabel.BUSY)  # ids are quoted in the path
        assert "a/b #1" in srv.engine.pools.entries

    run(go, gpu_kv_tokens=65536, cpu_ratio=0.5)


def test_non_ascii_ids_reach_the_engine_and_its_controls_intact() -> None:
    pid = '程序-é "q" /%41?#+ ✓'  # a header would carry its UTF-8 mis-decoded unencoded

    async def go(srv: EngineSimServer, a: SimEngineAdapter) -> None:
        assert a.request_headers(RequestHints(pid))["X-Program-Id"].isascii()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 3}
        resp = await a.forward("/v1/chat/completions", body, False,
                               RequestHints(pid, synthetic={"prompt_tokens": 2000}))
        assert resp.status == 200
        assert list(srv.engine.pools.entries) == [pid]
        assert (await a.residency()).gpu_tokens[pid] > 0
        await a.set_label(pid, KVLabel.IDLE)
        assert srv.engine.pools.entries[pid].label is KVLabel.IDLE
        await a.offload(pid)
        res = await a.residency()
        assert pid not in res.gpu_tokens and res.cpu_tokens[pid] > 0
        await a.drop(pid)
        assert srv.engine.program_state(pid)["cpu_tokens"] == 0

    run(go, gpu_kv_tokens=65536, cpu_ratio=0.5)


def test_errors_pass_through_and_unreachable_engine() -> None:
    async def go(srv: EngineSimServer, a: SimEngineAdapter) -> None:
        resp = await a.forward("/v1/chat/completions", {"model": "nope", "messages": [
            {"role": "user", "content": "x"}]}, True, RequestHints("p"))
        assert resp.status == 404 and resp.body is not None
        assert json.loads(resp.body)["error"]["code"] == "model_not_found"
        await srv.stop()
        with pytest.raises(UpstreamError) as e:
            await a.forward("/v1/completions", {"prompt": "x"}, False, RequestHints("p"))
        assert e.value.status == 503
        assert not await a.health()

    run(go)
