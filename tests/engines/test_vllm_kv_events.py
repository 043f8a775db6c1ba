"""The vLLM adapter's KV events: the recorded batches decoded and attributed to programs,
and the subscriber over a real ZMQ socket (batches replayed by a local publisher)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from mori.engines.base import RequestHints
from mori.engines.kvevents import KVEventDecodeError, decode_batch, decode_message
from mori.engines.kvindex import KVBlockIndex, token_chain_keys
from mori.engines.vllm import VLLMAdapter
from support.fake_engine import FakeEngine, Publisher

from .vllm_recorded import CHAT, RESPONSES, frames, with_engine

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
