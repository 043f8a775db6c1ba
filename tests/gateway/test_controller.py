"""The controller without HTTP: a fake clock, in-memory adapters, the real policy."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from mori.core.decisions import Demote, Forward, Promote, Release
from mori.core.types import Capability, KVLabel, Status, Tier
from mori.engines.base import EngineAdapter, KVCapacity, RequestHints, UpstreamResponse
from mori.gateway.app import policy_for
from mori.gateway.config import GatewaySettings
from mori.gateway.control import Controller
from mori.gateway.held import AdmissionRejected
from mori.gateway.metrics import GatewayMetrics
from mori.gateway.replicas import Replicas

PAGE = 16


class RecordingAdapter(EngineAdapter):
    """An engine replica that records the KV controls it is sent (no network)."""

    kind = "recording"

    def __init__(self, gpu_tokens: int = 1024, cpu_tokens: int = 1024,
                 capabilities: frozenset[Capability] = frozenset({
                     Capability.LABELS, Capability.OFFLOAD, Capability.DROP})) -> None:
        super().__init__("memory://replica")
        self.capabilities = capabilities
        self.cap = KVCapacity(gpu_tokens, cpu_tokens, PAGE, 1)
        self.controls: list[tuple[str, str, str | None]] = []

    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        return UpstreamResponse(200, {}, body=b"{}")

    async def capacity(self) -> KVCapacity:
        return self.cap

    async def health(self) -> bool:
        return True

    async def models(self) -> list[dict[str, Any]]:
        return [{"id": "m"}]

    async def set_label(self, program_id: str, label: KVLabel) -> None:
        self.controls.append(("label", program_id, label.value))

    async def offload(self, program_id: str) -> None:
        self.controls.append(("offload", program_id, None))

    async def drop(self, program_id: str) -> None:
        self.controls.append(("drop", program_id, None))

    async def release(self, program_id: str) -> None:
        self.controls.append(("release", program_id, None))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def run(body: Callable[[Controller, RecordingAdapter, FakeClock], Awaitable[None]],
        policy: str = "mori", adapter: RecordingAdapter | None = None,
        **settings: Any) -> None:
    async def go() -> None:
        a = adapter or RecordingAdapter()
        s = GatewaySettings(policy=policy, **settings)
        clock = FakeClock()
        ctl = Controller(policy_for(s, [a.cap]), [a], GatewayMetrics(), s, clock=clock)
        try:
            await body(ctl, a, clock)
            ctl.policy.check_integrity()
        finally:
            await ctl.stop()
    asyncio.run(go())


def decisions(ctl: Controller) -> list[Any]:
    return [r.decision for r in ctl.log]


def test_a_fitting_request_is_forwarded_and_its_step_reported() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        lease = await ctl.lease("p", 100)
        assert lease.admission.replica == 0 and not lease.admission.reloaded
        assert ctl.policy.programs["p"].status is Status.REASONING
        clock.t += 2.0
        lease.finish(150)
        lease.finish(999)  # once only
        assert ctl.policy.programs["p"].status is Status.ACTING
        assert ctl.policy.programs["p"].tokens == 150
        assert lease.replica.in_flight == 0
        assert decisions(ctl) == [Promote("p", 0, Tier.NONE), Forward("p", 0)]
        await ctl.replicas.controls_done(0)
        assert a.controls == [("label", "p", "busy")]
    run(body)


def test_room_is_made_by_demoting_the_acting_program_with_labels_in_order() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        la = await ctl.lease("a", 600)
        clock.t += 1.0
        la.finish(640)
        clock.t += 10.0  # a sits in a tool call
        lb = await ctl.lease("b", 600)
        assert decisions(ctl)[2:] == [Demote("a", 0, Tier.GPU, Tier.CPU),
                                       Promote("b", 0, Tier.NONE), Forward("b", 0)]
        await ctl.replicas.controls_done(0)
        assert a.controls == [("label", "a", "busy"), ("label", "a", "idle"),
                              ("label", "b", "busy")]
        lb.finish(620)
        assert ctl.executor.counts.demotions[Tier.CPU] == 1
    run(body)


def test_a_replica_without_labels_is_told_to_offload() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        la = await ctl.lease("a", 600)
        clock.t += 1.0
        la.finish(640)
        clock.t += 10.0
        lb = await ctl.lease("b", 600)
        assert decisions(ctl)[2:] == [Demote("a", 0, Tier.GPU, Tier.CPU),
                                       Promote("b", 0, Tier.NONE), Forward("b", 0)]
        await ctl.replicas.controls_done(0)
        assert a.controls == [("offload", "a", None)]
        lb.finish(620)
    run(body, adapter=RecordingAdapter(
        capabilities=frozenset({Capability.OFFLOAD, Capability.DROP})))


def test_a_thunderagent_pause_tells_the_engine_nothing() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        (await ctl.lease("a", 400)).finish(400)
        (await ctl.lease("b", 300)).finish(300)
        clock.t += 5.0  # the scheduler's 5 s check runs in this round
        lease = await ctl.lease("a", 800)  # through at once, then over capacity:
        assert decisions(ctl)[-2:] == [Forward("a", 0), Demote("b", 0, Tier.GPU, Tier.NONE)]
        await ctl.replicas.controls_done(0)
        assert a.controls == []  # the engine's LRU decides what b's KV becomes
        lease.finish(800)
    run(body, policy="thunderagent")


def test_a_held_request_times_out_then_its_orphan_forward_ends_the_step() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        la = await ctl.lease("a", 900)  # reasoning: nothing can be demoted for b
        with pytest.raises(AdmissionRejected) as e:
            await ctl.lease("b", 600)
        assert e.value.status == 503
        assert ctl.policy.programs["b"].status is Status.HELD  # still held for a retry
        clock.t += 1.0
        la.finish(900)  # a acting: b is forwarded, nobody waits, its step ends at once
        assert ctl.programs["b"].orphan_forwards == 1
        assert ctl.policy.programs["b"].status is Status.ACTING
    run(body, hold_timeout_s=0.05)


def test_the_held_requests_are_bounded() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        await ctl.lease("a", 900)
        first = asyncio.ensure_future(ctl.lease("b", 600))
        await asyncio.sleep(0)
        with pytest.raises(AdmissionRejected) as e:
            await ctl.lease("c", 600)
        assert e.value.status == 429 and e.value.retry_after_s == 5.0
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
    run(body, max_held=1)


def test_kv_ready_turns_the_wait_before_reasoning_into_held_time() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        lease = await ctl.lease("p", 100)
        clock.t += 0.5  # the engine's controls and prefetch took 0.5 s of wall time
        await lease.prepare("/v1/completions", {}, stream=False)
        assert ctl.policy.programs["p"].tracker.held_time == pytest.approx(0.5 * 4.0)
        lease.finish(120)
    run(body, time_scale=4.0)


def test_idle_programs_are_released_after_the_ttl() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        (await ctl.lease("p", 100)).finish(120)
        clock.t += 59.0
        ctl.tick()
        assert "p" in ctl.policy.programs
        clock.t += 2.0
        ctl.tick()
        assert "p" not in ctl.policy.programs and "p" not in ctl.programs
        assert decisions(ctl)[-1] == Release("p", 0)
        await ctl.replicas.controls_done(0)
        assert a.controls[-1] == ("release", "p", None)
    run(body, program_ttl_s=60.0)


@pytest.mark.parametrize("held", [20, 400])
def test_a_tick_looks_only_at_the_programs_past_the_ttl(held: int) -> None:
    """The idle timeout costs a tick what expires, not every program held: however many
    programs sit idle, a tick looks at those unseen past the TTL and one more."""
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        for i in range(held):
            clock.t += 1.0
            (await ctl.lease(f"p{i}", 100)).finish(120)
        lease = await ctl.lease(f"p{held - 1}", 130)  # in flight past the TTL below
        looked = ctl.seen.looked_at
        ctl.tick()
        assert ctl.seen.looked_at - looked == 1  # nobody is past the TTL
        # p0 .. p4 were last seen over 10,000 s ago, p5 not quite
        clock.t = 1000.0 + 5 + 10_000.5
        looked = ctl.seen.looked_at
        ctl.tick()
        assert ctl.seen.looked_at - looked == 6
        assert [f"p{i}" for i in range(6) if f"p{i}" in ctl.programs] == ["p5"]
        assert len(ctl.programs) == len(ctl.seen) == held - 5
        # a program in flight past the TTL stays (looked at until its step ends)
        clock.t += 100_000.0
        ctl.tick()
        assert list(ctl.programs) == [f"p{held - 1}"]
        lease.finish(140)
        looked = ctl.seen.looked_at
        ctl.tick()
        assert ctl.seen.looked_at - looked == 1 and list(ctl.programs) == [f"p{held - 1}"]
    run(body, program_ttl_s=10_000.0)


def test_an_unhealthy_replica_answers_503_and_leaves_no_program_reasoning() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        ctl.replicas.mark_unhealthy(0, "connection refused")
        with pytest.raises(AdmissionRejected) as e:
            await ctl.lease("p", 100)
        # the client is told to retry; the engine's URL and error stay in the log and
        # /healthz (for admins)
        assert e.value.status == 503 and "unhealthy" in e.value.message
        assert "memory://" not in e.value.message
        # refused before the policy heard of it, or left Acting: never stuck Reasoning
        assert "p" not in ctl.policy.programs or \
            ctl.policy.programs["p"].status is Status.ACTING
        assert ctl.replicas[0].in_flight == 0
    run(body)


def test_a_second_request_in_flight_and_a_released_program_get_409() -> None:
    async def body(ctl: Controller, a: RecordingAdapter, clock: FakeClock) -> None:
        lease = await ctl.lease("p", 100)
        with pytest.raises(AdmissionRejected) as e:
            await ctl.lease("p", 100)
        assert e.value.status == 409
        assert ctl.release("p")  # pending until its response ends
        with pytest.raises(AdmissionRejected):
            await ctl.lease("p", 100)
        lease.finish(110)
        assert "p" not in ctl.policy.programs
        assert not ctl.release("p")
    run(body)


class SlowLabelAdapter(RecordingAdapter):
    """Labels that take until ``release`` is set (a plug-in slow to answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.release_labels = asyncio.Event()

    async def set_label(self, program_id: str, label: KVLabel) -> None:
        await self.release_labels.wait()
        await super().set_label(program_id, label)


def test_a_client_leaving_does_not_cancel_the_replicas_controls() -> None:
    """A request waits for its replica's controls (``controls_done``); its client leaves
    (the handler is cancelled). The controls still run, in order, and a second request
    waiting on them is answered, not cancelled."""
    async def go() -> None:
        a = SlowLabelAdapter()
        reps = Replicas([a], health_interval_s=60.0)
        reps.set_label("p1", 0, KVLabel.IDLE)
        reps.set_label("p2", 0, KVLabel.BUSY)
        leaving = asyncio.ensure_future(reps.controls_done(0))
        staying = asyncio.ensure_future(reps.controls_done(0))
        await asyncio.sleep(0.01)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        a.release_labels.set()
        await asyncio.wait_for(staying, 5.0)
        assert a.controls == [("label", "p1", "idle"), ("label", "p2", "busy")]
    asyncio.run(go())


def test_a_cancelled_control_does_not_cancel_the_ones_after_it() -> None:
    async def go() -> None:
        a = SlowLabelAdapter()
        reps = Replicas([a], health_interval_s=60.0)
        reps.set_label("p1", 0, KVLabel.IDLE)
        first = reps.all[0].chain
        reps.set_label("p2", 0, KVLabel.BUSY)
        await asyncio.sleep(0.01)
        assert first is not None
        first.cancel()  # e.g. a label request given up on
        a.release_labels.set()
        await asyncio.wait_for(reps.controls_done(0), 5.0)
        assert a.controls == [("label", "p2", "busy")]
    asyncio.run(go())
