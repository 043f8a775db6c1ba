"""The engine's prices learned from its answers (``mori.gateway.engine_prices``): the
requests that ran alone on a replica are timed, the fit is shown in ``/v1/replicas`` and
handed to the policy (``--no-learn-costs``: shown, not used)."""

from __future__ import annotations

import httpx
import openai
import pytest
from gateway_harness import LoopThread, serve_on_simulated

from mori.gateway.agents import StepFacts
from mori.gateway.config import GatewaySettings


@pytest.mark.parametrize("learn", [True, False])
def test_requests_that_ran_alone_price_the_engine(loop_thread: LoopThread,
                                                  learn: bool) -> None:
    sg = serve_on_simulated(loop_thread, GatewaySettings(learn_costs=learn))
    client = openai.OpenAI(base_url=sg.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    for i in range(20):  # one at a time: each alone on the replica
        words = " ".join(["word"] * (50 * (i % 5 + 1)))
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{i} {words}"}],
            max_tokens=2, stream=True, stream_options={"include_usage": True},
            extra_body={"program_id": f"p{i}"})
        for _ in stream:
            pass
    rows = httpx.get(sg.url + "/v1/replicas").json()["data"]
    assert len(rows) == 1 and rows[0]["healthy"] is True
    costs = rows[0]["costs"]
    measured = costs["measured"]
    assert measured["samples"] == 20 and measured["reload_samples"] == 0
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


def test_only_a_prefill_that_ran_alone_is_timed(loop_thread: LoopThread) -> None:
    """Two requests prefilling at once on one replica: each one's time is partly the
    other's, so neither prices anything; a request sent once the other's first byte came
    (the other only decoding) is timed, and so is the other."""
    sg = serve_on_simulated(loop_thread, GatewaySettings())
    ctl = sg.gw.ctl
    seen: list[str] = []
    ctl.prices.observe = lambda r, reloaded, step: seen.append(f"{r}")  # type: ignore[method-assign]
    facts = StepFacts(100, 0, 1, (), 0.01)

    async def overlapping() -> None:
        first = await ctl.lease("a", 100)
        second = await ctl.lease("b", 100)
        assert first.alone and not second.alone
        second.finish(101, facts)
        first.finish(101, facts)  # b was sent while a prefilled: not alone after all
        assert not first.alone

    async def one_after_the_others_first_byte() -> None:
        first = await ctl.lease("c", 100)
        first.answering()
        second = await ctl.lease("d", 100)
        assert first.alone and second.alone
        second.finish(101, facts)
        first.finish(101, facts)

    loop_thread.call(overlapping())
    assert seen == []
    loop_thread.call(one_after_the_others_first_byte())
    assert seen == ["0", "0"]
    assert ctl.replicas.all[0].prefilling == 0


def test_the_replicas_view_needs_an_admin_key(loop_thread: LoopThread) -> None:
    sg = serve_on_simulated(loop_thread, GatewaySettings(api_keys=("user",),
                                                         admin_keys=("admin",)))
    assert httpx.get(sg.url + "/v1/replicas").status_code == 401
    assert httpx.get(sg.url + "/v1/replicas",
                     headers={"Authorization": "Bearer user"}).status_code == 403
    ok = httpx.get(sg.url + "/v1/replicas", headers={"Authorization": "Bearer admin"})
    assert ok.status_code == 200 and ok.json()["data"][0]["replica"] == 0
