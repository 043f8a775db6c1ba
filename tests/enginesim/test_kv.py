"""The simulated engine's KV controls over HTTP (``mori.enginesim``): labels, offloads
and drops change where a program's KV lives, and a small pool evicts under pressure.
"""

from __future__ import annotations

import math

import openai
import pytest

from mori.core.costmodel import get_preset
from mori.core.types import KVLabel
from mori.enginesim import EngineSimServer

from .harness import MODEL, PAGE, PRESET, client, http, run, synthetic

# -- KV controls ---------------------------------------------------------------------------

def test_kv_controls_change_residency() -> None:
    async def go(srv: EngineSimServer) -> None:
        status, cap = await http(srv, "GET", "/mori/v1/capacity")
        preset = get_preset(PRESET)
        assert cap == {"gpu_tokens": preset.gpu_kv_capacity_tokens,
                       "cpu_tokens": preset.gpu_kv_capacity_tokens // PAGE * PAGE,
                       "page_tokens": PAGE,
                       "kv_bytes_per_token": preset.kv_bytes_per_token_per_gpu * preset.tp}
        async with client(srv) as c:
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_body={"program_id": "p", **synthetic(5000)})
            _, res = await http(srv, "GET", "/mori/v1/residency")
            # whole pages only: the last partial page of 5,000 + 4 tokens is not kept
            assert res["gpu_tokens"]["p"] == 5004 // PAGE * PAGE
            assert "p" not in res["cpu_tokens"]
            status, state = await http(srv, "POST", "/mori/v1/programs/p/offload")
            assert status == 200 and state["gpu_tokens"] == 0
            _, res = await http(srv, "GET", "/mori/v1/residency")
            assert "p" not in res["gpu_tokens"]
            assert res["cpu_tokens"]["p"] == 5004 // PAGE * PAGE
            # the next step extends the conversation: its prefix is reloaded from the CPU
            r = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                extra_body={"program_id": "p", **synthetic(6000)})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            assert r.usage.prompt_tokens_details.cached_tokens == 5004 // PAGE * PAGE
            _, stats = await http(srv, "GET", "/mori/v1/stats")
            assert stats["cpu_hit_tokens"] == 5004 // PAGE * PAGE
        status, state = await http(srv, "POST", "/mori/v1/programs/p/label", {"label": "idle"})
        assert status == 200 and state["label"] == "idle"
        assert srv.engine.pools.entries["p"].label is KVLabel.IDLE
        status, _ = await http(srv, "POST", "/mori/v1/programs/p/label", {"label": "hot"})
        assert status == 400
        status, state = await http(srv, "POST", "/mori/v1/programs/p/drop")
        assert status == 200 and (state["gpu_tokens"], state["cpu_tokens"]) == (0, 0)
        _, res = await http(srv, "GET", "/mori/v1/residency")
        assert res == {"gpu_tokens": {}, "cpu_tokens": {}, "ended": []}
        status, err = await http(srv, "POST", "/mori/v1/programs/nobody/offload")
        assert status == 404 and err["error"]["code"] == "program_not_found"
        status, _ = await http(srv, "POST", "/mori/v1/programs/p/release")
        assert status == 200
        srv.engine.pools.check()

    run(go, cpu_ratio=1.0)


def test_small_pool_evicts_under_pressure() -> None:
    async def go(srv: EngineSimServer) -> None:
        kept = 0
        assert srv.engine.capacity()["gpu_tokens"] == 4096
        async with client(srv) as c:
            for pid in ("a", "b"):
                await c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body={"program_id": pid, **synthetic(2500)})
            _, res = await http(srv, "GET", "/mori/v1/residency")
            pages = math.ceil(2504 / PAGE)  # what a request of 2,504 tokens holds
            kept = 4096 // PAGE - pages  # b took what a had to give up (LRU, page by page)
            # each keeps its whole pages once done
            assert res["gpu_tokens"] == {"a": kept * PAGE, "b": 2504 // PAGE * PAGE}
            assert res["cpu_tokens"] == {}  # no CPU tier: evicted pages are gone
            # a's next step finds only what was left of it; the rest is recomputed
            r = await c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body={"program_id": "a", **synthetic(2600)})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            assert r.usage.prompt_tokens_details.cached_tokens == kept * PAGE
            with pytest.raises(openai.BadRequestError):  # can never fit the pool
                await c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                           extra_body=synthetic(5000))
        _, stats = await http(srv, "GET", "/mori/v1/stats")
        assert stats["evicted_gpu_tokens"] > 0
        assert stats["recomputed_tokens"] == 2504 - kept * PAGE
        srv.engine.pools.check()

    run(go, gpu_kv_tokens=4096)
