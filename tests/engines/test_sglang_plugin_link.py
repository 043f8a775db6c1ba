"""The SGLang adapter and the MORI plug-in: the routing header that names a request's
program, and the label channel (``labels`` option) against a fake plug-in, as the vLLM
adapter speaks it (``mori.engines.plugin_link``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.engines.test_sglang_adapter import routes

from mori.core.types import Capability, KVLabel
from mori.engines.base import RequestHints
from mori.engines.registry import parse_backend
from mori.engines.sglang import SGLangAdapter
from mori.sglang_plugin.order import ROUTING_HEADER, program_of
from support.fake_engine import FakeEngine
from support.fake_plugin import FakePlugin

FAST = {"labels_timeout_s": 1.0, "labels_check_s": 60.0}  # checks run by hand
PLUGIN_CAPS = {Capability.LABELS, Capability.DROP}


def test_every_request_names_its_program_for_the_plugin() -> None:
    """SGLang keeps the ``x-smg-routing-key`` header as the request's ``routing_key``;
    the plug-in reads the program back from it, whatever the id holds."""
    seen: list[dict[str, str]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
        await reader.readexactly(int(headers.get("content-length", "0")))
        seen.append({k.lower(): v for k, v in headers.items()})
        body = json.dumps({"id": "x", "object": "chat.completion", "choices": []}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    async def go() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        a = SGLangAdapter(f"http://127.0.0.1:{port}", priority=False)
        try:
            program = "team/ä agent:1 %"
            resp = await a.forward("/v1/chat/completions", {"messages": []}, False,
                                   RequestHints(program))
            assert resp.status == 200
            assert program_of(seen[0][ROUTING_HEADER]) == program
            assert seen[0][ROUTING_HEADER].isascii()
        finally:
            await a.close()
            server.close()
    asyncio.run(go())


def _run(fn: Any) -> Any:
    async def main() -> Any:
        eng = await FakeEngine(routes=routes()).start()
        plug = await FakePlugin().start()
        a = SGLangAdapter(eng.url, labels=plug.endpoint, **FAST)
        try:
            return await fn(a, plug)
        finally:
            await a.close()
            await plug.stop()
            plug.close()
            await eng.stop()
    return asyncio.run(main())


def test_handshake_declares_labels_and_drop_and_the_labels_go_over() -> None:
    async def go(a: SGLangAdapter, plug: FakePlugin) -> None:
        assert not (PLUGIN_CAPS & a.capabilities)
        await a.start()
        assert a.labels_up and a.capabilities >= PLUGIN_CAPS
        await a.set_label("p", KVLabel.IDLE)
        await a.drop("q")
        await a.release("r")  # released: inactive
        assert plug.ops == ["hello", "set", "drop", "set"]
        assert plug.labels == {"p": "idle", "r": "inactive"}
    _run(go)


def test_a_plugin_that_goes_away_falls_back_and_gets_the_table_again() -> None:
    async def go(a: SGLangAdapter, plug: FakePlugin) -> None:
        await a.start()
        await a.set_label("p1", KVLabel.BUSY)
        await plug.stop()
        await a.set_label("p2", KVLabel.IDLE)  # times out: the channel is down
        assert not a.labels_up and not (PLUGIN_CAPS & a.capabilities)
        await a.set_label("p1", KVLabel.INACTIVE)  # recorded only
        plug.labels = {}
        plug.received.clear()
        await plug.start()  # a restarted engine: no labels
        assert await a.check_labels()
        assert plug.ops == ["hello", "replace"]
        assert plug.labels == {"p1": "inactive", "p2": "idle"}
        assert a.capabilities >= PLUGIN_CAPS
    _run(go)


def test_the_backend_spec_takes_the_labels_option() -> None:
    a = parse_backend("sglang=http://127.0.0.1:30000,labels=tcp://127.0.0.1:5558").build()
    assert isinstance(a, SGLangAdapter) and a.link is not None
    assert a.link.channel.endpoint == "tcp://127.0.0.1:5558"
    plain = parse_backend("sglang=http://127.0.0.1:30000").build()
    assert isinstance(plain, SGLangAdapter) and plain.link is None
    assert not plain.supports(Capability.LABELS)


def test_residency_comes_from_the_plugin_while_it_answers() -> None:
    async def main() -> None:
        eng = await FakeEngine(routes=routes()).start()
        plug = await FakePlugin(residency={"gpu": {"a": 64}, "cpu": {"b": 32},
                                           "inactive": ["c"]}).start()
        a = SGLangAdapter(eng.url, labels=plug.endpoint, **FAST)
        try:
            assert not a.supports(Capability.RESIDENCY)  # no KV events: nothing to read
            await a.start()
            assert a.supports(Capability.RESIDENCY)
            res = await a.residency()
            assert (res.gpu_tokens, res.cpu_tokens, res.ended) == (
                {"a": 64}, {"b": 32}, frozenset({"c"}))
            await plug.stop()
            await a.set_label("x", KVLabel.IDLE)  # times out: the channel is down
            assert not a.supports(Capability.RESIDENCY)
        finally:
            await a.close()
            await plug.stop()
            plug.close()
            await eng.stop()
    asyncio.run(main())
