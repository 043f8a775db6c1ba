"""The engine's prices learned from its answers (``mori.gateway.engine_prices``): each
replica's time cut at the first bytes of the gateway's requests, the fit shown in
``/v1/replicas`` and handed to the policy (``--no-learn-costs``: shown, not used)."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_harness import LoopThread, serve_on_simulated

from mori.gateway.agents import StepFacts
from mori.gateway.config import GatewaySettings
from mori.gateway.engine_prices import PrefillClock


@pytest.mark.parametrize("learn", [True, False])
def test_requests_that_ran_alone_price_the_engine(loop_thread: LoopThread,
                                                  learn: bool) -> None:
    sg = serve_on_simulated(loop_thread, GatewaySettings(learn_costs=learn))
    client = openai.OpenAI(base_url=sg.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    for i in range(20):  # one at a time
        words = " ".join(["word"] * (50 * (i % 5 + 1)))
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{i} {words}"}],
            max_tokens=2, stream=True, stream_options={"include_usage": True},
            extra_body={"program_id": f"p{i}"})
        for _ in stream:
            pass
    rows = httpx.get(sg.url + "/v1/replicas").json()["data"]
    assert len(rows) == 1 and rows[0]["healthy"] is True
    # the policy's recent shares: its steps ran one at a time; the simulated engine
    # queued none of them (each was sent after the last ended)
    shares = rows[0]["shares"]
    assert 0 < shares["busy"] <= 1 and shares["queued"] == 0
    # the GPU tier the policy fills: the engine's pool (no overcommit asked for)
    pool = sg.gw.ctl.policy.pool_gpu_bytes // sg.gw.ctl.policy.kv_bytes_per_token
    assert rows[0]["gpu_tier"] == {"tokens": pool, "pool_tokens": pool} and pool > 0
    costs = rows[0]["costs"]
    measured = costs["measured"]
    # one stretch a request; the last one stays open until a next first byte ends it
    assert measured["samples"] == 19 and measured["reload_samples"] == 0
    assert measured["recompute_per_token_s"] is not None
    assert measured["recompute_per_token_s"] >= 0 and measured["base_s"] is not None
    assert costs["learning"] is learn
    used = costs["policy_prices"]["recompute_per_token_s"]
    policy = sg.gw.ctl.policy
    assert (policy.engine_costs[0] is not None) is learn
    if learn:  # handed over in policy seconds (time scale 1 here: the same figure)
        assert used == pytest.approx(measured["recompute_per_token_s"])
    else:
        assert used is None
    # the dashboard shows them beside the replica's tiers, in ms per 1,000 tokens
    (row,) = httpx.get(sg.url + "/dashboard/state").json()["frame"]["prices"]
    assert row[:2] == [0, 19]
    assert row[2] == pytest.approx(measured["recompute_per_token_s"] * 1e6, abs=0.01)


def test_the_engine_time_is_cut_at_first_bytes_first_come_first_served() -> None:
    """b is sent while a prefills: its prefill starts at a's first byte; c's first byte
    comes in the same engine step as b's (within 3 ms): one stretch of two prefills; d,
    sent after an idle gap, starts when it is sent."""
    clock = PrefillClock()
    a, closed = clock.answered(sent=0.0, at=0.020)
    assert (a.start, a.end, closed) == (0.0, 0.020, None)
    b, closed = clock.answered(sent=0.005, at=0.050)
    assert (b.start, b.end) == (0.020, 0.050) and closed is a and a.closed
    c, closed = clock.answered(sent=0.010, at=0.051)
    assert c is b and b.members == 2 and closed is None
    d, closed = clock.answered(sent=0.500, at=0.530)
    assert (d.start, closed) == (0.500, b)


def test_a_stretch_is_learned_once_all_its_requests_ended(loop_thread: LoopThread) -> None:
    sg = serve_on_simulated(loop_thread, GatewaySettings())
    prices = sg.gw.ctl.prices
    learner = prices.learners[0]
    s1 = prices.answered(0, 0.0, 0.02)
    s2 = prices.answered(0, 0.01, 0.05)  # closes s1 (not yet ended: nothing learned)
    s2b = prices.answered(0, 0.02, 0.051)
    assert s2b is s2 and learner.samples == 0
    prices.ended(0, s1, False, StepFacts(100, 0, 1))
    assert learner.samples == 1  # s1 was closed and complete
    prices.ended(0, s2, True, StepFacts(300, 200, 1))
    prices.ended(0, s2b, False, None)  # failed: the stretch is left out
    prices.answered(0, 1.0, 1.02)  # closes s2
    assert learner.samples == 1 and learner.reload_samples == 0


def test_the_replicas_view_needs_an_admin_key(loop_thread: LoopThread) -> None:
    sg = serve_on_simulated(loop_thread, GatewaySettings(api_keys=("user",),
                                                         admin_keys=("admin",)))
    assert httpx.get(sg.url + "/v1/replicas").status_code == 401
    assert httpx.get(sg.url + "/v1/replicas",
                     headers={"Authorization": "Bearer user"}).status_code == 403
    ok = httpx.get(sg.url + "/v1/replicas", headers={"Authorization": "Bearer admin"})
    assert ok.status_code == 200 and ok.json()["data"][0]["replica"] == 0
