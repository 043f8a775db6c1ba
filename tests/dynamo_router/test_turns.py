"""Dynamo's preprocessed requests as MORI's turns, and back (no Dynamo needed)."""

from __future__ import annotations

from typing import Any

import pytest

from mori.dynamo.fleet import (
    CardError,
    WorkerSlots,
    active_requests,
    capacity_of,
    tier_overlaps,
)
from mori.dynamo.turns import (
    ChunkFacts,
    Turn,
    TurnError,
    forwarded,
    read_turn,
    wants_engine_data,
    with_engine_data,
)


def request(ctx: Any = None, tokens: Any = (1, 2, 3), **more: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"token_ids": list(tokens) if isinstance(tokens, tuple) else tokens,
                         "model": "m", "routing": {}, **more}
    if ctx is not None:
        r["agent_context"] = ctx
    return r


def test_a_turn_names_its_program_parent_and_end() -> None:
    assert read_turn(request({"session_id": " p1 ", "parent_session_id": "p0",
                              "input_trigger": "user_message"})) == Turn("p1", "p0", False, 3)
    assert read_turn(request({"session_id": "p1", "session_final": True})).final
    assert read_turn(request()) == Turn(None, None, False, 3)  # a one-off
    assert read_turn(request({"session_id": "  "})).program_id is None
    assert read_turn(request({"session_id": "p", "parent_session_id": "p"})).parent is None


@pytest.mark.parametrize(("req", "says"), [
    (request({"session_id": "p"}, tokens=[]), "token_ids"),
    (request({"session_id": "p"}, tokens=None), "ModelInput.Tokens"),
    (request("p1"), "agent_context must be an object"),
    (request({"session_id": 7}), "x-dynamo-session-id"),
    (request({"session_id": "x" * 300}), "at most 256"),
    (request({"session_id": "\udcff"}), "valid Unicode"),
    (request({"session_id": "a\x00b"}), "control characters"),
    (request({"session_id": "dynamo-one-off-0"}), "may not start with"),
    (request({"session_id": "p", "parent_session_id": ["a"]}), "x-dynamo-parent-session-id"),
    (request({"session_id": "p", "session_final": "yes"}), "true or false"),
    (request({"session_final": True}), "session_final without a session_id"),
])
def test_bad_requests_say_what_to_fix(req: dict[str, Any], says: str) -> None:
    with pytest.raises(TurnError, match=says):
        read_turn(req)


def test_the_request_sent_on_is_pinned_and_moved_up() -> None:
    orig = request({"session_id": "p"}, routing={"priority_jump": 1.5, "x": 1})
    out = forwarded(orig, 42, 2.0)
    assert out["routing"] == {"backend_instance_id": 42, "dp_rank": 0, "priority_jump": 3.5,
                              "x": 1}
    assert orig["routing"] == {"priority_jump": 1.5, "x": 1}  # the original is untouched
    assert forwarded(request(routing=None), 7, 0.0)["routing"] == {
        "backend_instance_id": 7, "dp_rank": 0}
    assert forwarded(request(routing={"dp_rank": 3}), 7, 0.0)["routing"]["dp_rank"] == 3


def test_chunks_give_usage_cached_tokens_and_the_worker() -> None:
    seen = ChunkFacts()
    seen.read({"token_ids": [5], "completion_usage": {
        "prompt_tokens": 100, "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 64}},
        "routing_data": {"worker_id": {"decode_worker_id": 9, "decode_dp_rank": 0}}})
    seen.read({"token_ids": [6, 7]})
    assert (seen.prompt_tokens, seen.cached_tokens, seen.worker_id) == (100, 64, 9)
    assert seen.completion_tokens == 3 and seen.context_tokens(90) == 103
    seen.read({"token_ids": [], "finish_reason": "length",
               "completion_usage": {"prompt_tokens": 100, "completion_tokens": 8}})
    assert seen.completion_tokens == 8 and seen.finish_reason == "length"
    seen.read("not a chunk")
    assert ChunkFacts().context_tokens(90) == 90


def test_engine_data_only_when_asked() -> None:
    assert wants_engine_data({"nvext": {"extra_fields": ["engine_data"]}})
    assert wants_engine_data({"extra_args": {"nvext": {"extra_fields": ["engine_data"]}}})
    assert not wants_engine_data({"nvext": {"extra_fields": ["timing"]}})
    chunk = with_engine_data({"token_ids": [], "engine_data": {"other": 1}}, "mori", {"a": 2})
    assert chunk["engine_data"] == {"other": 1, "mori": {"a": 2}}
    assert with_engine_data("raw", "mori", {}) == "raw"


def test_slots_follow_workers_that_come_and_go() -> None:
    slots = WorkerSlots(2, misses=2)
    changes = slots.update([30, 10, 20])
    assert slots.workers == [10, 20] and [c.worker_id for c in changes] == [10, 20]
    assert slots.unplaced([10, 20, 30]) == [30]
    assert slots.update([20, 30]) == []  # one reading without 10: not gone yet
    changes = slots.update([20, 30])
    assert [(c.slot, c.worker_id, c.previous) for c in changes] == [(0, None, 10),
                                                                   (0, 30, 10)]
    assert slots.workers == [30, 20] and slots.slot_of(20) == 1 and slots.live == 2
    # a worker whose requests fail gives its slot to a new one
    changes = slots.update([20, 30, 40], failed=[30])
    assert slots.workers == [40, 20] and changes[-1].previous == 30
    with pytest.raises(ValueError, match="--workers"):
        WorkerSlots(0)


def test_capacity_comes_from_the_model_card() -> None:
    card = {"kv_cache_block_size": 16, "runtime_config": {"total_kv_blocks": 64}}
    cap = capacity_of(card)
    assert (cap.gpu_tokens, cap.cpu_tokens, cap.page_tokens) == (1024, 0, 16)
    assert capacity_of(card, host_tokens=4096).cpu_tokens == 4096
    native = {"kv_cache_block_size": 16, "runtime_config": {
        "total_kv_blocks": 64, "runtime_data": {
            "native_offloading_capacity": {"total_tokens": 2048}}}}
    assert capacity_of(native).cpu_tokens == 2048
    with pytest.raises(CardError, match="--num-gpu-blocks-override"):
        capacity_of({"kv_cache_block_size": 16, "runtime_config": {}})


def test_overlap_scores_by_tier_and_loads() -> None:
    scores = {"block_size": 16, "num_blocks": 40, "workers": [
        {"worker_id": 1, "dp_rank": 0, "device_blocks": 10, "host_pinned_blocks": 30,
         "disk_blocks": 30},
        {"worker_id": 2, "dp_rank": 0, "device_blocks": 0, "host_pinned_blocks": 0,
         "disk_blocks": 5},
        {"worker_id": "bad"}]}
    tiers = tier_overlaps(scores)
    assert set(tiers) == {1, 2}
    assert (tiers[1].device_tokens, tiers[1].host_tokens, tiers[1].disk_tokens) == (160, 320, 0)
    assert tiers[2].disk_tokens == 80 and tiers[2].cached_tokens == 80
    assert tier_overlaps({"workers": []}) == {}
    assert active_requests([{"worker_id": 1, "dp_rank": 0, "active_requests": 2},
                            {"worker_id": 1, "dp_rank": 1, "active_requests": 1},
                            {"worker_id": 2}]) == {1: 3}
