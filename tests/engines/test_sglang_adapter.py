"""The SGLang adapter against a fake server answering with fixtures written from SGLang's
documented schemas (tests/data/sglang/README.md: written by hand, not recorded)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from mori.engines.base import Capability, NotSupportedError, RequestHints
from mori.engines.registry import ADAPTERS, parse_backend
from mori.engines.sglang import SGLangAdapter, hicache_flags
from support.fake_engine import FakeEngine, Publisher

DATA = Path(__file__).resolve().parents[1] / "data" / "sglang"
T = TypeVar("T")


def fixture(name: str) -> Any:
    text = (DATA / name).read_text()
    return json.loads(text) if name.endswith(".json") else text


def routes(info: str = "get_server_info.json") -> dict[str, Any]:
    return {
        "GET /get_server_info": fixture(info),
        "GET /health": "",
        "POST /v1/chat/completions": fixture("chat_completion.json"),
        "POST /v1/tokenize": fixture("tokenize.json"),
    }


def with_engine(fn: Callable[[FakeEngine], Awaitable[T]], **kw: Any) -> T:
    async def main() -> T:
        eng = await FakeEngine(routes=routes(**kw)).start()
        try:
            return await fn(eng)
        finally:
            await eng.stop()
    return asyncio.run(main())


CHAT = {"model": "m", "messages": [{"role": "user", "content": "run the tests"}]}


def test_capacity_with_hicache_ratio() -> None:
    async def go(eng: FakeEngine) -> None:
        a = SGLangAdapter(eng.url)
        await a.start()
        try:
            cap = await a.capacity()
            # host pool = 2 x device pool, write-through: 1 x device pool beyond the GPU
            assert (cap.gpu_tokens, cap.cpu_tokens, cap.page_tokens) == (769728, 769728, 64)
            assert a.supports(Capability.PRIORITY) and a.supports(Capability.PREFETCH)
            assert a.priority_low_first is False
        finally:
            await a.close()
    with_engine(go)


def test_capacity_hicache_size_needs_bytes_per_token() -> None:
    async def go(eng: FakeEngine) -> None:
        a = SGLangAdapter(eng.url)
        b = SGLangAdapter(eng.url, kv_bytes_per_token=50_000)
        c = SGLangAdapter(eng.url, cpu_tokens=123)
        for x in (a, b, c):
            await x.start()
        try:
            assert (await a.capacity()).cpu_tokens == 0
            # 100 GB / 50 kB per token = 2,000,000 host tokens, less the device pool
            assert (await b.capacity()).cpu_tokens == 2_000_000 - 769728
            assert (await c.capacity()).cpu_tokens == 123
            assert not a.supports(Capability.PRIORITY)  # the server has it off
        finally:
            for x in (a, b, c):
                await x.close()
    with_engine(go, info="get_server_info_hicache_size.json")


def test_priority_convention_high_first() -> None:
    async def go(eng: FakeEngine) -> None:
        a = SGLangAdapter(eng.url)
        await a.start()
        try:
            assert a.shape_body(dict(CHAT), RequestHints("p", priority=0))["priority"] == 0
            assert a.shape_body(dict(CHAT), RequestHints("p", priority=3))["priority"] == -3
            resp = await a.forward("/v1/chat/completions", CHAT, False,
                                   RequestHints("p", priority=2))
            assert resp.status == 200
            assert eng.posted[-1][1]["priority"] == -2
            b = SGLangAdapter(eng.url, priority_base=100)
            await b.start()
            assert b.shape_body(dict(CHAT), RequestHints("p", priority=3))["priority"] == 97
            await b.close()
        finally:
            await a.close()
    with_engine(go)


def test_priority_convention_low_first_and_no_hicache() -> None:
    async def go(eng: FakeEngine) -> None:
        a = SGLangAdapter(eng.url)
        await a.start()
        try:
            assert a.priority_low_first is True
            assert a.shape_body(dict(CHAT), RequestHints("p", priority=3))["priority"] == 3
            cap = await a.capacity()
            assert (cap.cpu_tokens, cap.page_tokens) == (0, 1)
            assert not a.supports(Capability.PREFETCH)
            with pytest.raises(NotSupportedError):
                await a.prefetch("p", "/v1/chat/completions", CHAT)
        finally:
            await a.close()
    with_engine(go, info="get_server_info_low_first.json")


def test_priority_disabled_sends_no_priority() -> None:
    a = SGLangAdapter("http://x", priority=False)
    assert "priority" not in a.shape_body(dict(CHAT), RequestHints("p", priority=3))
    assert not a.supports(Capability.PRIORITY)


def test_prefetch_warmup_with_hicache() -> None:
    async def go(eng: FakeEngine) -> None:
        a = SGLangAdapter(eng.url)
        await a.start()
        try:
            await a.prefetch("p", "/v1/chat/completions", {**CHAT, "stream": True})
            sent = eng.posted[-1][1]
            assert sent["max_tokens"] == 1 and sent["stream"] is False
            assert sent["priority"] == 0
        finally:
            await a.close()
    with_engine(go)


def test_hicache_flags() -> None:
    flags = hicache_flags(events_port=6000)
    for f in ("--enable-hierarchical-cache", "--enable-priority-scheduling",
              "--enable-metrics", "--kv-events-config"):
        assert f in flags
    assert flags[flags.index("--radix-eviction-policy") + 1] == "priority"
    cfg = json.loads(flags[flags.index("--kv-events-config") + 1])
    assert cfg["endpoint"] == "tcp://*:6000" and cfg["enable_kv_cache_events"] is True


def test_registry_and_backend_spec() -> None:
    assert ADAPTERS.get("sglang") is SGLangAdapter
    a = parse_backend("sglang=http://127.0.0.1:30000,priority_low_first=true,"
                      "kv_tokens=1000").build()
    assert isinstance(a, SGLangAdapter)
    assert a.priority_low_first is True and a.kv_tokens == 1000
    with pytest.raises(ValueError, match="attribution"):
        SGLangAdapter("http://x", attribution="salt")


def test_residency_from_sglang_array_events() -> None:
    """SGLang's events: array form, media GPU / CPU_PINNED, no session or salt; programs
    are attributed by the prompt token ids from /v1/tokenize."""
    prompt = fixture("tokenize.json")["tokens"]  # 11 tokens

    def batch(seq: int, events: list[Any]) -> list[bytes]:
        return [b"kv-events", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events])]

    async def go(eng: FakeEngine) -> None:
        pub = Publisher()
        a = SGLangAdapter(eng.url, kv_events=pub.endpoint)
        await a.start()
        try:
            assert a.supports(Capability.RESIDENCY) and a.supports(Capability.TOKENIZE)
            assert await a.count_prompt_tokens("/v1/chat/completions", CHAT) == 11
            await a.forward("/v1/chat/completions", CHAT, False, RequestHints("prog-1"))
            assert a.index is not None
            idx = a.index
            probe = [b"kv-events", msgspec.msgpack.encode([0.0, []])]
            loop = asyncio.get_running_loop()
            end = loop.time() + 10
            while idx.stats.batches == 0:
                assert loop.time() < end, "subscriber never joined"
                await pub.send(probe)
                await asyncio.sleep(0.05)
            await pub.send(batch(0, [
                ["BlockStored", [11, 12], None, prompt[:8], 4, None, "GPU"],
                ["BlockStored", [13], 12, [7, 7, 7, 7], 4, None, "GPU"],  # generated tokens
                ["BlockStored", [11], None, prompt[:4], 4, None, "CPU_PINNED"],
            ]))
            await pub.send(batch(1, [["BlockRemoved", [12, 13], "GPU"]]))
            end = loop.time() + 10
            while idx.stats.last_seq != 1:
                assert loop.time() < end
                await asyncio.sleep(0.02)
            res = await a.residency()
            assert dict(res.gpu_tokens) == {"prog-1": 4}
            assert dict(res.cpu_tokens) == {"prog-1": 4}
        finally:
            await a.close()
            pub.close()
    with_engine(go)
