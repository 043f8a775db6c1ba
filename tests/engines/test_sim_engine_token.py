"""The simulated engine's token: an engine-sim started with one answers 401 (JSON, in the
API's shape) to every request without it but ``GET /health``; ``SimEngineAdapter`` sends
it on every call; the engines ``mori serve`` starts in-process always have a random one,
known only to the gateway, so another local user can neither read their programs
(``/mori/v1/residency``) nor run completions on their loopback ports."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from mori.cli.engine_sim_cmd import ScriptOptionError, token_of
from mori.cli.main import build_parser
from mori.core.costmodel import get_preset
from mori.core.types import KVLabel
from mori.engines.base import RequestHints, UpstreamError
from mori.engines.registry import parse_backend, shown
from mori.engines.simulated import SimEngineAdapter
from mori.enginesim import EngineSimConfig, EngineSimServer, start_engine_sim
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig, sim_backend_spec, start_simulated_backends

PRESET = "h200-80g-qwen2.5-7b"
MODEL = get_preset(PRESET).model.name
TOKEN = "tok-3b9f0c2e7a"
# a prompt of a few pages: the engine keeps a request's whole pages only
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 200}],
        "max_tokens": 2}


def run(fn: Callable[[EngineSimServer], Awaitable[None]], token: str | None = TOKEN) -> None:
    async def main() -> None:
        srv = await start_engine_sim(EngineSimConfig(PRESET, time_scale=1000.0), token=token)
        try:
            await asyncio.wait_for(fn(srv), 15)
        finally:
            await srv.stop()

    asyncio.run(main())


REFUSED = [("GET", "/v1/models", None), ("GET", "/metrics", None),
           ("GET", "/mori/v1/residency", None), ("GET", "/mori/v1/capacity", None),
           ("GET", "/mori/v1/stats", None), ("POST", "/mori/v1/programs/p/release", {}),
           ("POST", "/mori/v1/programs/p/label", {"label": "idle"}),
           ("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", CHAT),
           ("POST", "/v1/responses", CHAT), ("GET", "/no/such/path", None)]


def test_without_the_token_every_route_but_health_is_401() -> None:
    async def check(srv: EngineSimServer) -> None:
        async with httpx.AsyncClient(base_url=srv.url) as c:
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": TOKEN}, {"Authorization": f"Bearer {TOKEN}x"},
                            {"x-api-key": TOKEN[:-1]}):
                for method, path, body in REFUSED:
                    r = await c.request(method, path, json=body, headers=headers)
                    assert r.status_code == 401, (method, path, headers)
                    err = r.json()["error"]
                    assert err["code"] == "invalid_token" and "token" in err["message"]
                    assert r.headers["www-authenticate"] == "Bearer"
                    assert TOKEN not in r.text
                r = await c.post("/v1/messages", json=CHAT, headers=headers)
                assert r.status_code == 401
                assert r.json()["type"] == "error"  # Anthropic's shape
                assert r.json()["error"]["type"] == "authentication_error"
            assert (await c.get("/health")).status_code == 200
            assert srv.engine.stats()["requests"] == 0  # nothing ran
            # with it: served (both ways of sending a key)
            for headers in ({"Authorization": f"Bearer {TOKEN}"}, {"x-api-key": TOKEN}):
                r = await c.get("/mori/v1/residency", headers=headers)
                assert r.status_code == 200, r.text
                r = await c.post("/v1/chat/completions", json=CHAT, headers=headers)
                assert r.status_code == 200, r.text

    run(check)


def test_without_a_token_the_engine_is_open_as_before() -> None:
    async def check(srv: EngineSimServer) -> None:
        assert srv.token is None
        async with httpx.AsyncClient(base_url=srv.url) as c:
            assert (await c.get("/mori/v1/residency")).status_code == 200
            r = await c.get("/no/such/path")  # errors are JSON all the same
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

    run(check, token=None)


def test_the_adapter_sends_its_token_on_every_call() -> None:
    async def check(srv: EngineSimServer) -> None:
        good = SimEngineAdapter(srv.url, token=TOKEN)
        bad = SimEngineAdapter(srv.url)
        for a in (good, bad):
            await a.start()
        try:
            assert (await good.capacity()).gpu_tokens > 0
            assert [m["id"] for m in await good.models()] == [MODEL]
            up = await good.forward("/v1/chat/completions", dict(CHAT), False,
                                    RequestHints("p1"))
            assert up.status == 200, up.body
            await good.set_label("p1", KVLabel.IDLE)
            assert "p1" in (await good.residency()).gpu_tokens
            await good.release("p1")
            assert await good.health() and await good.load() is not None
            with pytest.raises(UpstreamError):
                await bad.capacity()
            up = await bad.forward("/v1/chat/completions", dict(CHAT), False,
                                   RequestHints("p2"))
            assert up.status == 401
            assert await bad.load() is None
        finally:
            for a in (good, bad):
                await a.close()

    run(check)


def test_the_embedded_engines_require_a_token_only_the_gateway_has() -> None:
    async def check() -> None:
        cfg = ServeConfig(replicas=2, settings=GatewaySettings(time_scale=100.0))
        adapters, handles = await start_simulated_backends(cfg)
        try:
            tokens = {h.token for h in handles}
            assert len(tokens) == 2 and None not in tokens  # one each, random
            async with httpx.AsyncClient() as c:
                for a, h in zip(adapters, handles, strict=True):
                    assert isinstance(a, SimEngineAdapter) and a.token == h.token
                    assert len(h.token) >= 40
                    r = await c.get(h.url + "/mori/v1/residency")
                    assert r.status_code == 401  # another local user: refused
                    r = await c.post(h.url + "/v1/chat/completions", json=CHAT)
                    assert r.status_code == 401
                    await a.start()
                    try:
                        assert (await a.capacity()).gpu_tokens > 0
                    finally:
                        await a.close()
                    # the workers are given the token in their backend spec
                    spec = parse_backend(sim_backend_spec(a))
                    assert spec.options == {"token": h.token}
        finally:
            for h in handles:
                await h.stop()

    asyncio.run(check())


def test_backend_option_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORI_ENGINE_TOKEN", raising=False)
    a = parse_backend("sim=http://127.0.0.1:9,token=0123").build()
    assert isinstance(a, SimEngineAdapter) and a.token == "0123"  # verbatim, not a number
    assert a.session_headers() == {"authorization": "Bearer 0123"}
    assert a.request_headers(RequestHints("p"))["authorization"] == "Bearer 0123"
    assert shown("sim=http://h:1,token=0123,x=1") == "sim=http://h:1,token=***,x=1"
    plain = SimEngineAdapter("http://127.0.0.1:9")
    assert plain.token is None and plain.session_headers() == {}
    assert "authorization" not in plain.request_headers(RequestHints("p"))
    monkeypatch.setenv("MORI_ENGINE_TOKEN", "from-env")
    assert SimEngineAdapter("http://127.0.0.1:9").token == "from-env"
    assert SimEngineAdapter("http://127.0.0.1:9", token="given").token == "given"


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["engine-sim", "--preset", PRESET, *argv])


def test_engine_sim_command_token() -> None:
    assert token_of(_args(), {}) is None  # off by default
    assert token_of(_args(), {"MORI_ENGINE_TOKEN": "env-tok"}) == "env-tok"
    assert token_of(_args("--token", "flag-tok"), {"MORI_ENGINE_TOKEN": "e"}) == "flag-tok"
    with pytest.raises(ScriptOptionError, match="token"):
        token_of(_args("--token", "has space"), {})
