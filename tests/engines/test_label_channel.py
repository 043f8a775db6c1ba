"""The gateway's side of the label channel: ``LabelChannel`` and the vLLM adapter's
``labels`` option, against a fake MORI plug-in (``support.fake_plugin``: a ZMQ ROUTER in
the test's event loop that answers as ``mori.plugin_channel.protocol`` says and records what
it receives)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mori.core.decisions import Demote, Promote
from mori.core.execution import SetLabel, engine_actions
from mori.core.policy import EngineProfile
from mori.core.types import Capability, KVLabel, Tier
from mori.engines.base import NotSupportedError, RequestHints, UpstreamError
from mori.engines.label_channel import LabelChannel, LabelChannelDown, LabelRefused
from mori.engines.registry import parse_backend
from mori.engines.vllm import VLLMAdapter
from mori.gateway.app import policy_for
from mori.gateway.config import GatewaySettings
from mori.plugin_channel import protocol
from support.fake_engine import FakeEngine
from support.fake_plugin import FakePlugin, free_port

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"
METRICS = (DATA / "metrics_idle.txt").read_text()  # 64 GPU blocks x 32 tokens, no CPU tier
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
T = TypeVar("T")
FAST = {"labels_timeout_s": 1.0, "labels_check_s": 60.0}  # checks run by hand
PLUGIN_CAPS = {Capability.LABELS, Capability.DROP}


def run(fn: Callable[[FakeEngine], Awaitable[T]]) -> T:
    """Run ``fn`` with a fake vLLM HTTP server (its recorded idle ``/metrics``)."""
    async def main() -> T:
        eng = await FakeEngine(routes={
            "GET /metrics": METRICS, "GET /health": "",
            "GET /v1/models": {"object": "list", "data": [{"id": "tiny"}]},
        }).start()
        try:
            return await fn(eng)
        finally:
            await eng.stop()
    return asyncio.run(main())


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.02)


# -- the channel alone ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def plugged(eng: FakeEngine, plugin: dict[str, Any] | None = None,
                  **adapter: Any) -> AsyncIterator[tuple[VLLMAdapter, FakePlugin]]:
    """A fake plug-in and a vLLM adapter labelling through it, both closed afterwards."""
    plug = await FakePlugin(**(plugin or {})).start()
    a = VLLMAdapter(eng.url, labels=plug.endpoint, **{**FAST, **adapter})
    try:
        yield a, plug
    finally:
        await a.close()
        await plug.stop()
        plug.close()

def test_channel_messages_follow_the_protocol() -> None:
    async def go() -> None:
        plug = await FakePlugin(cpu_tier_tokens=4096).start()
        ch = LabelChannel(plug.endpoint, timeout_s=2.0)
        try:
            hello = await ch.hello()
            assert hello["ok"] and hello["cpu_tier_tokens"] == 4096
            assert hello["block_size"] == 32 and hello["gpu_blocks"] == 64
            await ch.set_label("p1", "busy")
            await ch.set_label("p2", "idle")
            await ch.drop("p1")
            await ch.replace()
            await ch.clear()
            await ch.replace({"p3": "inactive"})
            assert plug.received == [
                {"v": 1, "op": "hello"},
                {"v": 1, "op": "set", "labels": {"p1": "busy"}},
                {"v": 1, "op": "set", "labels": {"p2": "idle"}},
                {"v": 1, "op": "drop", "program": "p1"},
                {"v": 1, "op": "replace", "labels": {"p2": "idle"}},
                {"v": 1, "op": "clear"},
                {"v": 1, "op": "replace", "labels": {"p3": "inactive"}},
            ]
            assert ch.table == plug.labels == {"p3": "inactive"}
        finally:
            await ch.close()
            await plug.stop()
            plug.close()
    asyncio.run(go())


def test_channel_refusals() -> None:
    async def go() -> None:
        plug = await FakePlugin().start()
        ch = LabelChannel(plug.endpoint)
        try:
            with pytest.raises(LabelRefused, match="not one of"):
                await ch.set_label("p", "hot")  # refused here, never sent
            with pytest.raises(LabelRefused, match="1 to 1024"):
                await ch.set_label("x" * 1025, "busy")
            assert plug.received == [] and ch.table == {}
            ch.table["p"] = "warm"  # what the plug-in refuses comes back as LabelRefused
            with pytest.raises(LabelRefused, match="refused 'replace'"):
                await ch.replace()
            assert (await ch.hello())["ok"]  # the channel is still up
        finally:
            await ch.close()
            await plug.stop()
            plug.close()
    asyncio.run(go())


def test_channel_timeout_resets_and_late_replies_are_not_taken() -> None:
    async def go() -> None:
        plug = await FakePlugin().start()
        ch = LabelChannel(plug.endpoint, timeout_s=0.2)
        try:
            plug.delay_s = 0.5  # the reply comes after the timeout
            with pytest.raises(LabelChannelDown, match="within 0.2 s"):
                await ch.set_label("p1", "busy")
            assert ch.resets == 1
            assert ch.table == {"p1": "busy"}  # kept, to re-send
            plug.delay_s = 0.0
            await asyncio.sleep(0.5)  # the late reply went to the closed socket
            hello = await ch.hello()
            assert hello["op"] == "hello"  # not the late answer to "set"
        finally:
            await ch.close()
            await plug.stop()
            plug.close()
    asyncio.run(go())


def test_channel_without_plugin_does_not_pile_up() -> None:
    async def go() -> None:
        ch = LabelChannel(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.1)
        try:
            t0 = asyncio.get_running_loop().time()
            for i in range(5):
                with pytest.raises(LabelChannelDown):
                    await ch.set_label(f"p{i}", "idle")
            assert asyncio.get_running_loop().time() - t0 < 3.0
            assert ch.resets == 5 and len(ch.table) == 5
            plug = await FakePlugin(port=int(ch.endpoint.rsplit(":", 1)[1])).start()
            ch.timeout_s = 2.0
            try:
                assert (await ch.hello())["ok"]
                assert plug.ops == ["hello"]  # nothing queued from while it was away
            finally:
                await plug.stop()
                plug.close()
        finally:
            await ch.close()
    asyncio.run(go())


# -- the adapter ----------------------------------------------------------------------------

def test_handshake_declares_labels_and_drop_and_cpu_tier() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, plugin=dict(cpu_tier_tokens=8192), **FAST) as (a, plug):
            await a.start()
            assert a.capabilities >= PLUGIN_CAPS and a.labels_up
            cap = await a.capacity()
            # 63 usable blocks of 32; the write-through host tier mirrors them, so the
            # policy's CPU tier is what it holds beyond the GPU pool
            assert (cap.gpu_tokens, cap.cpu_tokens) == (2016, 8192 - 2016)
            assert a.supports(Capability.PREFETCH)  # a host tier: warm-ups make sense
            assert plug.ops == ["hello"]  # a fresh adapter neither clears nor replaces
            assert a.plugin is not None and a.plugin["plugin_version"]
            # the executor now emits labels for a typed-eviction policy on this replica
            typed = EngineProfile(cpu_tier=True, typed_eviction=True)
            acts = engine_actions(Promote("p", 0, Tier.NONE), typed, a.capabilities)
            assert acts == (SetLabel("p", 0, KVLabel.BUSY),)
    run(go)


def test_a_host_tier_no_larger_than_the_gpu_pool_gives_no_cpu_tier() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, plugin=dict(cpu_tier_tokens=2016), **FAST) as (a, plug):
            await a.start()
            assert (await a.capacity()).cpu_tokens == 0
            assert not a.supports(Capability.PREFETCH)
    run(go)


def test_a_disk_tier_in_the_handshake_sizes_the_policys_disk_and_takes_cold_labels(
        ) -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, plugin=dict(cpu_tier_tokens=8192, disk_tier_tokens=40000),
                           **FAST) as (a, plug):
            await a.start()
            cap = await a.capacity()
            # the disk tier is written through from the host tier: the policy's disk is
            # what it holds beyond the host tier
            assert (cap.cpu_tokens, cap.disk_tokens) == (8192 - 2016, 40000 - 8192)
            policy = policy_for(GatewaySettings(policy="mori"), [cap, cap])
            assert policy.cluster.disk_bytes == (40000 - 8192) // 32 * 32 * 1
            await a.set_label("p1", KVLabel.COLD)
            await until(lambda: plug.labels.get("p1") == "cold")
    run(go)


def test_operator_cpu_tokens_win_over_the_handshake() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, plugin=dict(cpu_tier_tokens=8192), cpu_tokens=1000, **FAST) as (a, plug):
            await a.start()
            assert (await a.capacity()).cpu_tokens == 1000
    run(go)


def test_controls_go_over_the_channel() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, **FAST) as (a, plug):
            await a.start()
            await a.set_label("p1", KVLabel.BUSY)
            await a.set_label("p2", KVLabel.IDLE)
            await a.drop("p2")
            await a.release("p1")
            assert plug.received[1:] == [
                {"v": 1, "op": "set", "labels": {"p1": "busy"}},
                {"v": 1, "op": "set", "labels": {"p2": "idle"}},
                {"v": 1, "op": "drop", "program": "p2"},
                {"v": 1, "op": "set", "labels": {"p1": "inactive"}},
            ]
            assert plug.labels == {"p1": "inactive"}
            assert a.label_channel is not None and a.label_channel.table == plug.labels
            with pytest.raises(UpstreamError, match="1 to 1024"):
                await a.set_label("x" * 2000, KVLabel.BUSY)
            assert a.labels_up  # a refusal does not take the channel down
    run(go)


def test_non_ascii_ids_cross_the_channel_intact() -> None:
    odd = '程序-é "q" \\ /%20 ✓'
    frame = protocol.encode("set", labels={odd: "busy"})
    frame.decode("ascii")  # JSON escapes: the frame is plain ASCII, valid UTF-8
    assert protocol.decode(frame).labels == {odd: "busy"}

    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, **FAST) as (a, plug):
            await a.start()
            await a.set_label(odd, KVLabel.IDLE)
            await a.drop(odd)
            await a.set_label(odd, KVLabel.BUSY)
            assert plug.received[1:] == [
                {"v": 1, "op": "set", "labels": {odd: "idle"}},
                {"v": 1, "op": "drop", "program": odd},
                {"v": 1, "op": "set", "labels": {odd: "busy"}},
            ]
            assert [k.encode() for k in plug.labels] == [odd.encode()]  # byte-identical
    run(go)


HELD = {"gpu": {"a": 64, "b": 32}, "cpu": {"b": 96}, "inactive": ["b"]}


def test_residency_comes_from_the_plugin_while_it_answers() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, plugin=dict(residency=HELD), **FAST) as (a, plug):
            assert not a.supports(Capability.RESIDENCY)  # no KV events, no handshake yet
            await a.start()
            assert a.supports(Capability.RESIDENCY)
            res = await a.residency()
            assert (dict(res.gpu_tokens), dict(res.cpu_tokens), res.ended) == (
                {"a": 64, "b": 32}, {"b": 96}, frozenset({"b"}))
            assert plug.ops == ["hello", "residency"]
            plug.silent = True  # the engine goes quiet: a clean error, the capability goes
            with pytest.raises(UpstreamError, match="did not tell its residency"):
                await a.residency()
            assert not a.supports(Capability.RESIDENCY) and not a.labels_up
            plug.silent = False
            assert await a.check_labels() and a.supports(Capability.RESIDENCY)
    run(go)


def test_an_older_plugin_without_the_op_leaves_residency_to_kv_events() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, kv_events="tcp://127.0.0.1:9") as (a, plug):
            await a.start()
            assert a.labels_up and a.supports(Capability.RESIDENCY)  # from the events
            res = await a.residency()  # the (empty) event index, not the plug-in
            assert not res.gpu_tokens and "residency" not in plug.ops
        async with plugged(eng) as (a, plug):
            await a.start()
            assert a.labels_up and not a.supports(Capability.RESIDENCY)
    run(go)


def test_a_malformed_residency_falls_back_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    async def go(eng: FakeEngine) -> None:
        bad = {"gpu": {"a": -1}, "cpu": {}, "inactive": []}
        async with plugged(eng, plugin=dict(residency=bad), **FAST) as (a, _):
            await a.start()
            with pytest.raises(UpstreamError, match="residency"):
                await a.residency()
            assert a.labels_up  # a bad answer is not a dead channel
    with caplog.at_level(logging.WARNING, logger="mori.engines.vllm"):
        run(go)
    assert any("'gpu' is not an object of program -> tokens" in r.getMessage()
               for r in caplog.records)


def test_without_plugin_the_adapter_works_as_before(caplog: pytest.LogCaptureFixture) -> None:
    async def go(eng: FakeEngine) -> None:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        a = VLLMAdapter(eng.url, labels=endpoint, **FAST)
        try:
            await a.start()
            assert not (PLUGIN_CAPS & a.capabilities) and not a.labels_up
            assert {Capability.PRIORITY, Capability.TOKENIZE} <= a.capabilities
            cap = await a.capacity()
            assert (cap.gpu_tokens, cap.cpu_tokens) == (2016, 0)  # 63 usable blocks of 32
            resp = await a.forward("/v1/chat/completions", CHAT, False, RequestHints("p"))
            assert resp.status == 200
            # controls issued anyway (a race with the capability change) are recorded only
            await a.set_label("p", KVLabel.IDLE)
            await a.release("q")
            await a.drop("p")
            assert a.label_channel is not None and a.label_channel.table == {"q": "inactive"}
            assert not await a.check_labels()
            assert not await a.check_labels()
        finally:
            await a.close()
    with caplog.at_level(logging.DEBUG, logger="mori.engines.vllm"):
        run(go)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "plain LRU" in warnings[0].getMessage()
    assert "did not answer at tcp://127.0.0.1:" in warnings[0].getMessage()


def test_without_labels_option_no_label_controls() -> None:
    async def go() -> None:
        a = VLLMAdapter("http://127.0.0.1:9")
        assert a.label_channel is None and not (PLUGIN_CAPS & a.capabilities)
        with pytest.raises(NotSupportedError, match="labels=ENDPOINT"):
            await a.set_label("p", KVLabel.BUSY)
        with pytest.raises(NotSupportedError):
            await a.drop("p")
        await a.release("p")  # nothing to tell the engine
        assert not await a.check_labels()
    asyncio.run(go())


def test_plugin_goes_away_and_comes_back(caplog: pytest.LogCaptureFixture) -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, **FAST) as (a, plug):
            await a.start()
            await a.set_label("p1", KVLabel.BUSY)
            await a.set_label("p2", KVLabel.IDLE)
            await plug.stop()  # the engine went away
            await a.set_label("p3", KVLabel.IDLE)  # times out: the channel is down
            assert not a.labels_up and not (PLUGIN_CAPS & a.capabilities)
            await a.set_label("p1", KVLabel.INACTIVE)  # recorded only
            await a.drop("p2")
            assert not await a.check_labels()
            plug.labels = {}
            plug.received.clear()
            await plug.start()  # it is back (the restarted engine has no labels)
            assert await a.check_labels()
            assert plug.ops == ["hello", "replace"]
            assert plug.received[1]["labels"] == {"p1": "inactive", "p3": "idle"}
            assert plug.labels == {"p1": "inactive", "p3": "idle"}
            assert a.capabilities >= PLUGIN_CAPS and a.labels_up
            await a.set_label("p4", KVLabel.BUSY)
            assert plug.ops[-1] == "set"
    with caplog.at_level(logging.INFO, logger="mori.engines.vllm"):
        run(go)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("stopped answering" in m for m in msgs) == 1  # once per transition
    assert sum("label table re-sent (2 programs)" in m for m in msgs) == 1


def test_background_check_falls_back_and_restores() -> None:
    async def go(eng: FakeEngine) -> None:
        plug = await FakePlugin().start()
        a = VLLMAdapter(eng.url, labels=plug.endpoint, labels_timeout_s=0.2,
                        labels_check_s=0.1)
        try:
            await a.start()
            await a.set_label("p1", KVLabel.BUSY)
            plug.silent = True  # the engine hangs: no answers
            await until(lambda: Capability.LABELS not in a.capabilities)
            plug.silent = False
            await until(lambda: Capability.LABELS in a.capabilities)
            assert "replace" in plug.ops
            assert a.plugin_connections == 2
        finally:
            await a.close()
            await plug.stop()
            plug.close()
    run(go)


def test_another_plugin_instance_between_checks_gets_the_table() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, **FAST) as (a, plug):
            await a.start()
            await a.set_label("p1", KVLabel.IDLE)
            # the engine restarted (a new instance, no labels) without the channel noticing
            plug.labels, plug.instance = {}, uuid.uuid4().hex
            assert await a.check_labels()
            assert plug.ops[-2:] == ["hello", "replace"]
            assert plug.labels == {"p1": "idle"}
            assert await a.check_labels()
            assert plug.ops[-1] == "hello"  # it has them now: nothing re-sent
    run(go)


def test_engine_restart_between_checks_gets_the_table_back() -> None:
    async def go(eng: FakeEngine) -> None:
        async with plugged(eng, **FAST) as (a, plug):
            await a.start()
            await a.set_label("p1", KVLabel.IDLE)
            await plug.restart()  # a new socket on the same endpoint, no labels
            # the first check may go to the old connection and get no answer (then the
            # channel is down and the next check reconnects) or reach the new one
            for _ in range(3):
                if await a.check_labels():
                    break
            assert a.labels_up and a.capabilities >= PLUGIN_CAPS
            assert plug.ops[-1] == "replace" and plug.labels == {"p1": "idle"}
    run(go)


def test_plugin_starting_after_the_gateway_gets_recorded_labels_without_clearing() -> None:
    async def go(eng: FakeEngine) -> None:
        port = free_port()
        a = VLLMAdapter(eng.url, labels=f"tcp://127.0.0.1:{port}", **FAST)
        plug = FakePlugin(port=port)
        try:
            await a.start()
            await a.release("p1")
            await plug.start()
            plug.labels = {"old": "idle"}  # kept from an earlier gateway
            assert await a.check_labels()
            assert plug.ops == ["hello", "set"]
            assert plug.labels == {"old": "idle", "p1": "inactive"}
        finally:
            await a.close()
            await plug.stop()
            plug.close()
    run(go)


def test_backend_spec_takes_labels() -> None:
    a = parse_backend("vllm=http://127.0.0.1:8000,kv_events=tcp://127.0.0.1:5557,"
                      "labels=tcp://127.0.0.1:5558,labels_timeout_s=1.5").build()
    assert isinstance(a, VLLMAdapter) and a.label_channel is not None
    assert (a.label_channel.endpoint, a.label_channel.timeout_s) == ("tcp://127.0.0.1:5558",
                                                                     1.5)
    with pytest.raises(ValueError, match="labels_check_s"):
        VLLMAdapter("http://x", labels="tcp://127.0.0.1:5558", labels_check_s=0)


def test_demote_without_labels_uses_drop_when_the_plugin_answers() -> None:
    # an untyped policy on a plug-in engine: Demote to NONE of a GPU program drops its KV
    untyped = EngineProfile(cpu_tier=False, typed_eviction=False)
    acts = engine_actions(Demote("p", 0, Tier.GPU, Tier.NONE), untyped,
                          frozenset(PLUGIN_CAPS))
    assert [type(x).__name__ for x in acts] == ["Drop"]


def test_serve_takes_the_disk_read_rate_the_policy_prices_with() -> None:
    from mori.cli.main import build_parser
    from mori.cli.serve_cmd import ServeUsageError, build_config

    def config(*argv: str) -> Any:
        return build_config(build_parser().parse_args(["serve", *argv]))

    assert config("--disk-read-gbps", "2.5").settings.policy_config.disk_read_gbps == 2.5
    assert config().settings.policy_config.disk_read_gbps is None  # the default drive's
    with pytest.raises(ServeUsageError, match="--disk-read-gbps"):
        config("--disk-read-gbps", "-1")
