"""MORI's scheduler classes, built as vLLM's EngineCore builds a scheduler (no model runs:
the steps' outputs are made up), with labels sent over the real label channel."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from mori.plugin_channel import protocol
from mori.plugin_channel.protocol import encode
from mori.vllm_plugin.scheduler import MoriAsyncScheduler, MoriScheduler
from mori.vllm_plugin.typed_queue import TypedFreeBlockQueue

from .conftest import (
    ENGINE_BLOCK,
    ENGINE_BLOCKS,
    Request,
    SamplingParams,
    engine_configs,
    free_port,
    sha256,
    tiny_model_dir,
)

BLOCK = ENGINE_BLOCK
NUM_BLOCKS = ENGINE_BLOCKS  # 16 usable
HASHER = get_request_block_hasher(BLOCK, sha256)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[VllmConfig, KVCacheConfig]:
    return engine_configs(tiny_model_dir(tmp_path_factory), ["layer"])


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> str:
    ep = f"tcp://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MORI_LABEL_ENDPOINT", ep)
    return ep


def build(cls: type, configs: tuple[VllmConfig, KVCacheConfig]) -> Any:
    vc, kvc = configs
    return cls(vllm_config=vc, kv_cache_config=kvc,
               structured_output_manager=StructuredOutputManager(vc), block_size=BLOCK,
               log_stats=False)


@contextmanager
def connect(endpoint: str) -> Iterator[Any]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def ask(op: str, **fields: Any) -> dict[str, Any]:
        sock.send(encode(op, **fields))
        assert sock.poll(5000), f"no reply to {op} within 5 s"
        return protocol.decode_reply(sock.recv_multipart()[-1])

    try:
        yield ask
    finally:
        sock.close(0)
        ctx.term()


@pytest.fixture
def dealer(endpoint: str) -> Iterator[Any]:
    with connect(endpoint) as ask:
        yield ask


def request(rid: str, program: str | None, n_blocks: int, base: int) -> Request:
    return Request(rid, [base + i for i in range(n_blocks * BLOCK)],
                   SamplingParams(max_tokens=1), None, block_hasher=HASHER,
                   session_id=program)


def run_to_completion(s: Any, max_steps: int = 20) -> None:
    for _ in range(max_steps):
        if not s.has_requests():
            return
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        # vLLM 0.34 derives req_id_to_index from req_ids (no longer a field)
        index = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}
                 if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {})
        s.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[[7] for _ in ids], **index))
    pytest.fail("the requests did not finish")


def test_mori_scheduler_end_to_end(configs: Any, endpoint: str, dealer: Any,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.mori_plugin")
    s = build(MoriScheduler, configs)
    try:
        pool = s.kv_cache_manager.block_pool
        q = pool.free_block_queue
        assert isinstance(q, TypedFreeBlockQueue) and q is s.mori_queue
        assert q.num_free_blocks == NUM_BLOCKS - 1
        hello = dealer("hello")
        assert hello["ok"] and hello["block_size"] == BLOCK
        assert hello["gpu_blocks"] == NUM_BLOCKS and hello["cpu_tier_tokens"] == 0
        assert "residency" in hello["ops"]
        # what this vLLM's OpenAI request models read from a body (0.32-0.34: session_id)
        assert hello["request_fields"] == ["session_id"]
        assert dealer("residency") == {"v": 1, "op": "residency", "ok": True, "gpu": {},
                                       "cpu": {}, "inactive": []}

        for rid, prog, base in (("ra", "a", 1000), ("rb", "b", 2000), ("rn", None, 3000)):
            s.add_request(request(rid, prog, 3, base))
        run_to_completion(s)
        a, b = s.mori_labels.blocks_of("a"), s.mori_labels.blocks_of("b")
        assert len(a) == len(b) == 3 and not a & b
        assert q.sizes() == {"unhashed": 7, "inactive": 0, "cold": 0, "idle": 0, "busy": 9}
        # what a restarted gateway reads: each program's cached blocks, in tokens
        res = dealer("residency")
        assert (res["gpu"], res["cpu"], res["inactive"]) == (
            {"a": 3 * BLOCK, "b": 3 * BLOCK}, {}, [])

        assert dealer("set", labels={"a": "inactive", "b": "idle"})["ok"]
        assert q.sizes()["busy"] == 9  # applied at the next step, not before
        s.add_request(request("rc", "c", 2, 4000))
        run_to_completion(s)
        sizes = q.sizes()
        assert (sizes["inactive"], sizes["idle"]) == (3, 3), sizes
        assert hello["programs"] == 0 and dealer("hello")["programs"] == 2
        assert dealer("residency")["inactive"] == ["a"]  # released: not to be taken back
        assert any("MORI labels applied" in r.getMessage() for r in caplog.records)

        # under memory pressure, after the blocks never cached: a's, then b's, then the rest
        cached = [blk.block_id for blk in q.get_all_free_blocks()
                  if blk.block_hash is not None]
        assert set(cached[:3]) == a and set(cached[3:6]) == b

        # drop: b's cached blocks are evicted (no hash, first in the queue)
        assert dealer("drop", program="b")["ok"]
        s.schedule()
        assert all(pool.blocks[x].block_hash is None for x in b)
        assert q.sizes()["idle"] == 0 and "b" not in s.mori_labels.labels()
        assert set(dealer("residency")["gpu"]) == {"a", "c"}  # b's KV is gone

        # a bad message changes nothing and the engine goes on
        assert dealer("set", labels={"a": "sleepy"})["ok"] is False
        s.schedule()

        # reset: every hash is gone, the queue is re-sorted
        assert s.reset_prefix_cache()
        assert q.sizes() == {"unhashed": NUM_BLOCKS - 1, "inactive": 0, "cold": 0, "idle": 0,
                             "busy": 0}
        assert dealer("residency")["gpu"] == {}
    finally:
        s.shutdown()
    assert not s.mori_server.running


def test_mori_async_scheduler_and_the_endpoint_from_additional_config(
        configs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mori vllm-args`` passes the endpoint as ``--additional-config``."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MORI_LABEL_ENDPOINT", "tcp://127.0.0.1:1")  # overridden
    monkeypatch.setattr(configs[0], "additional_config", {"mori_label_endpoint": ep})
    s = build(MoriAsyncScheduler, configs)
    try:
        assert isinstance(s.kv_cache_manager.block_pool.free_block_queue, TypedFreeBlockQueue)
        assert s.mori_server.endpoint == ep
        with connect(ep) as ask:
            assert ask("hello")["ok"]
    finally:
        s.shutdown()


def test_the_scheduler_drives_moris_cpu_tier(configs: Any, endpoint: str, dealer: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With the offloading connector loaded (``mori vllm-args --cpu-gib``), the scheduler
    binds the connector's cache policy to its labels, tags requests with their program,
    reports the tier's size, and relabels the host chunks when labels arrive."""
    from vllm.config import KVTransferConfig

    from mori.vllm_plugin.connector_config import PROGRAM_KEY, kv_transfer_config
    from mori.vllm_plugin.cpu_tier import MoriCachePolicy

    vc, kvc = configs
    kvt = KVTransferConfig(**kv_transfer_config(1 << 20, block_size=2 * BLOCK))
    monkeypatch.setattr(vc, "kv_transfer_config", kvt)
    s = build(MoriScheduler, (vc, kvc))
    try:
        assert len(s.mori_cpu_policies) == 1
        pol = s.mori_cpu_policies[0]
        assert isinstance(pol, MoriCachePolicy) and pol.bound
        assert s.connector.connector_scheduler.manager._policy is pol  # vLLM's own one
        hello = dealer("hello")
        assert hello["cpu_tier_tokens"] == pol.cache_capacity * 2 * BLOCK > 0
        assert s.mori_chunk_tokens == 2 * BLOCK
        # larger than the pool: the gateway parks programs there, in MORI's order
        assert hello["cpu_tier_tokens"] > NUM_BLOCKS * BLOCK
        assert not s.mori_cpu_mirror_only and not pol.mirror_only

        req = request("ra", "a", 3, 1000)
        req.kv_transfer_params = {"other": 1}
        s.add_request(req)
        assert req.kv_transfer_params == {"other": 1, PROGRAM_KEY: "a"}
        anon = request("rn", None, 2, 3000)
        s.add_request(anon)
        assert not (anon.kv_transfer_params or {}).get(PROGRAM_KEY)

        # the policy reads the scheduler's labels
        assert dealer("set", labels={"a": "idle", "b": "inactive"})["ok"]
        s.schedule()
        assert pol._label("a") == "idle" and pol._label("b") == "inactive"
        calls: list[tuple[str, Any]] = []
        monkeypatch.setattr(pol, "relabel", lambda ps: calls.append(("relabel", set(ps))))
        monkeypatch.setattr(pol, "relabel_all", lambda: calls.append(("all", None)))
        monkeypatch.setattr(pol, "drop", lambda p: calls.append(("drop", p)))
        assert dealer("set", labels={"a": "busy"})["ok"]
        s.schedule()
        assert calls == [("relabel", {"a"})]
        calls.clear()
        assert dealer("drop", program="a")["ok"] and dealer("replace", labels={})["ok"]
        s.schedule()
        assert calls == [("drop", "a"), ("all", None)]
    finally:
        s.shutdown()


def test_a_cpu_tier_no_larger_than_the_pool_is_mirror_only(
        configs: Any, endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import KVTransferConfig

    from mori.vllm_plugin.connector_config import kv_transfer_config

    vc, kvc = configs
    sizes: dict[int, tuple[int, bool, bool]] = {}
    for cpu_bytes in (1 << 20, 1 << 14):
        kvt = KVTransferConfig(**kv_transfer_config(cpu_bytes, block_size=2 * BLOCK))
        monkeypatch.setattr(vc, "kv_transfer_config", kvt)
        s = build(MoriScheduler, (vc, kvc))
        try:
            pol = s.mori_cpu_policies[0]
            sizes[cpu_bytes] = (s.mori_cpu_tier_tokens, s.mori_cpu_mirror_only,
                                pol.mirror_only)
        finally:
            s.shutdown()
    big, small = sizes[1 << 20], sizes[1 << 14]
    assert 0 < small[0] <= NUM_BLOCKS * BLOCK < big[0]
    assert small[1:] == (True, True) and big[1:] == (False, False)


def test_without_a_cpu_tier_nothing_is_tagged(configs: Any, endpoint: str) -> None:
    s = build(MoriScheduler, configs)
    try:
        assert s.mori_cpu_policies == [] and s.mori_cpu_tier_tokens == 0
        req = request("ra", "a", 1, 1000)
        s.add_request(req)
        assert req.kv_transfer_params is None
    finally:
        s.shutdown()
