"""A turn through the real control loop and policy, with Dynamo's forward faked."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from mori.dynamo.fleet import WorkerSlots
from mori.dynamo.replica import DynamoReplica
from mori.dynamo.turn_handler import ENGINE_DATA_KEY, RouterError, TurnHandler
from mori.engines.base import KVCapacity
from mori.gateway.app import policy_for
from mori.gateway.config import GatewaySettings
from mori.gateway.control import Controller
from mori.gateway.metrics import GatewayMetrics

WORKERS = [111, 222]
CAP = KVCapacity(gpu_tokens=1024, cpu_tokens=4096, page_tokens=16)


class Fleet:
    def __init__(self, slots: WorkerSlots) -> None:
        self.slots = slots

    def worker(self, slot: int) -> int | None:
        return self.slots.worker(slot)

    def capacity(self, slot: int) -> KVCapacity | None:
        return CAP

    def active(self, slot: int) -> int | None:
        return None


class FakeDynamo:
    """Dynamo's forward: records what it was sent, answers like the mocker, and can be
    made to wait (``gate``) or to fail (``fail``)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.fail = False

    async def forward(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        self.sent.append(request)
        if self.fail:
            raise ConnectionError("TCP connection to 127.0.0.1:1 failed")
        pid = (request.get("agent_context") or {}).get("session_id")
        gate = self.gates.get(pid)
        prompt = len(request["token_ids"])

        async def chunks() -> AsyncIterator[Any]:
            if gate is not None:
                await gate.wait()
            yield {"token_ids": [9], "completion_usage": {
                "prompt_tokens": prompt, "completion_tokens": 1,
                "prompt_tokens_details": {"cached_tokens": 32}}}
            yield {"token_ids": [9], "finish_reason": "length", "completion_usage": {
                "prompt_tokens": prompt, "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 32}}}
        return chunks()


def run(body: Callable[[TurnHandler, FakeDynamo], Awaitable[None]]) -> None:
    async def go() -> None:
        settings = GatewaySettings(hold_timeout_s=5.0)
        slots = WorkerSlots(2)
        slots.update(WORKERS)
        fleet = Fleet(slots)
        loop = asyncio.get_running_loop()
        replicas = [DynamoReplica("dynamo.backend.generate", i, fleet, loop.time)
                    for i in range(2)]
        ctl = Controller(policy_for(settings, [CAP, CAP]), list(replicas), GatewayMetrics(),
                         settings)
        dyn = FakeDynamo()
        handler = TurnHandler(ctl, slots, replicas, dyn.forward, max_prompt_tokens=1024)
        try:
            await body(handler, dyn)
            ctl.policy.check_integrity()
        finally:
            await ctl.stop()
    asyncio.run(go())


def req(pid: str | None, n: int, final: bool = False, report: bool = True) -> dict[str, Any]:
    r: dict[str, Any] = {"token_ids": list(range(n)), "model": "m", "routing": {}}
    if pid is not None:
        r["agent_context"] = {"session_id": pid, "session_final": final}
    if report:
        r["nvext"] = {"extra_fields": ["engine_data"]}
    return r


async def answer(handler: TurnHandler, request: dict[str, Any]) -> list[Any]:
    return [c async for c in handler.handle(request)]


def report(chunks: list[Any]) -> dict[str, Any]:
    data: dict[str, Any] = chunks[-1]["engine_data"][ENGINE_DATA_KEY]
    return data


def test_a_program_stays_pinned_to_its_worker_and_its_steps_are_reported() -> None:
    async def body(h: TurnHandler, dyn: FakeDynamo) -> None:
        r1 = report(await answer(h, req("a", 200)))
        r2 = report(await answer(h, req("a", 260)))
        assert r1["worker_id"] == r2["worker_id"] in WORKERS
        assert dyn.sent[1]["routing"]["backend_instance_id"] == r1["worker_id"]
        assert "priority_jump" not in dyn.sent[1]["routing"]  # not held: no jump
        assert (r2["steps"], r2["cached_tokens"], r2["held_s"]) == (2, 32, 0.0)
        b = report(await answer(h, req("b", 200)))
        assert b["worker_id"] != r1["worker_id"]  # a new program goes to the emptier one
        p = h.controller.policy.programs["a"]
        assert p.tokens == 262  # the prompt and the two tokens out
        assert h.counts.turns == 3 and h.counts.cached_tokens == 96
    run(body)


def test_a_held_turn_waits_and_then_jumps_the_engine_queue() -> None:
    async def body(h: TurnHandler, dyn: FakeDynamo) -> None:
        dyn.gates["a"], dyn.gates["c"] = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(answer(h, req("a", 900)))
        c = asyncio.create_task(answer(h, req("c", 900)))
        await asyncio.sleep(0.05)
        b = asyncio.create_task(answer(h, req("b", 900)))  # no room while a and c run
        await asyncio.sleep(0.1)
        assert len(dyn.sent) == 2 and not b.done()
        dyn.gates["a"].set()
        await a
        rb = report(await asyncio.wait_for(b, 5))
        assert rb["held_s"] >= 0.1
        assert dyn.sent[2]["routing"]["priority_jump"] == pytest.approx(rb["held_s"], abs=1e-3)
        assert h.counts.held == 1
        dyn.gates["c"].set()
        await c
    run(body)


def test_session_final_releases_without_forwarding() -> None:
    async def body(h: TurnHandler, dyn: FakeDynamo) -> None:
        await answer(h, req("a", 100))
        assert "a" in h.controller.policy.programs
        assert await answer(h, req("a", 5, final=True)) == []
        assert len(dyn.sent) == 1 and "a" not in h.controller.policy.programs
        assert h.counts.released == 1
        assert await answer(h, req("unknown", 5, final=True)) == []
        assert h.counts.released == 1
    run(body)


def test_a_one_off_request_is_a_one_step_program() -> None:
    async def body(h: TurnHandler, dyn: FakeDynamo) -> None:
        chunks = await answer(h, req(None, 50))
        assert report(chunks)["program_id"].startswith("dynamo-one-off-")
        assert not h.controller.policy.programs and h.counts.one_offs == 1
        no_report = await answer(h, req("x", 50, report=False))
        assert all("engine_data" not in c for c in no_report)
    run(body)


def test_bad_input_and_a_failing_worker_give_clean_errors() -> None:
    async def body(h: TurnHandler, dyn: FakeDynamo) -> None:
        with pytest.raises(RouterError, match="token_ids") as e:
            await answer(h, {"agent_context": {"session_id": "a"}})
        assert e.value.status == 400
        with pytest.raises(RouterError, match="holds 1024") as e:
            await answer(h, req("big", 2000))
        assert e.value.status == 400 and not dyn.sent
        dyn.fail = True
        with pytest.raises(RouterError, match="places the program on another") as e:
            await answer(h, req("a", 100))
        assert e.value.status == 503
        slot = h.slots.slot_of(dyn.sent[0]["routing"]["backend_instance_id"])
        assert slot is not None
        ctl = h.controller
        assert not ctl.replicas[slot].healthy
        assert h.replicas[slot].failing == h.slots.worker(slot)
        assert not await h.replicas[slot].health()
        dyn.fail = False
        r = report(await answer(h, req("a", 100)))  # placed on the other worker
        assert r["replica"] != slot
        assert h.counts.failed == 1 and h.counts.turns == 2  # the failed one ended a step too
    run(body)
