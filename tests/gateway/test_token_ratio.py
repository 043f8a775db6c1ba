"""Prompt sizes estimated at arrival and scaled by what the engines counted
(``mori.gateway.token_ratio``): the ratio learned from answers' usage, per model, within
bounds; and through a gateway, an engine that counts three times the estimate makes the
next request of the model arrive three times the size."""

from __future__ import annotations

import math

import httpx
import pytest
from gateway_harness import LoopThread
from hypothesis import given
from hypothesis import strategies as st
from test_hostile_upstream import CHAT, HostileEngine, absurd_answer, request

from mori.engines.http import OpenAIHTTPAdapter
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.token_ratio import BOUNDS, DECAY, TokenRatio
from mori.protocol.tokens import text_prompt_tokens


def test_no_answer_leaves_the_estimate_as_it_is() -> None:
    r = TokenRatio()
    assert r.ratio("m") is None and r.scaled("m", 120) == 120


def test_the_ratio_follows_recent_answers_per_model() -> None:
    r = TokenRatio()
    r.observe("m", 100, 300)
    assert r.ratio("m") == pytest.approx(3.0) and r.scaled("m", 10) == 30
    assert r.ratio("other") is None  # another model's tokenizer is its own
    r.observe("m", 100, 100)  # the older answer weighs DECAY
    assert r.ratio("m") == pytest.approx((DECAY * 300 + 100) / (DECAY * 100 + 100))
    for _ in range(200):  # an engine that changed: the old count fades
        r.observe("m", 50, 100)
    assert r.ratio("m") == pytest.approx(2.0, rel=1e-6)


def test_absurd_counts_are_bounded_or_ignored() -> None:
    r = TokenRatio()
    r.observe("m", 0, 10)
    r.observe("m", 10, 0)
    assert r.ratio("m") is None
    r.observe("m", 1, 10**9)
    assert r.ratio("m") == BOUNDS[1]
    r = TokenRatio()
    r.observe("m", 10**9, 1)
    assert r.ratio("m") == BOUNDS[0] and r.scaled("m", 1) == 1


@given(st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 10**6)), min_size=1,
                max_size=30), st.integers(1, 10**6))
def test_a_scaled_estimate_stays_within_the_bounds(answers: list[tuple[int, int]],
                                                   estimate: int) -> None:
    r = TokenRatio()
    for est, exact in answers:
        r.observe("m", est, exact)
    got = r.scaled("m", estimate)
    assert got >= 1
    assert math.floor(estimate * BOUNDS[0]) <= got <= math.ceil(estimate * BOUNDS[1])


def test_the_gateway_learns_the_engines_count_from_its_answers() -> None:
    """The engine counts 3x the gateway's estimate of this request; after its answer the
    gateway's estimate of the same text is 3x (no /tokenize: ``exact_tokens`` off)."""
    body = request(CHAT, "p1", stream=False)
    est = text_prompt_tokens(CHAT, {k: v for k, v in body.items() if k != "program_id"},
                             strict=False)
    answer = absurd_answer(CHAT)
    answer["usage"] = {"prompt_tokens": 3 * est, "completion_tokens": 2}
    lt = LoopThread()
    try:
        engine = HostileEngine(answer=answer)
        lt.call(engine.start())
        lt.handles.append(engine)
        app = create_app(GatewaySettings(health_interval_s=60.0),
                         [OpenAIHTTPAdapter(engine.url, kv_tokens=100_000)])
        running = lt.serve(app)
        r = httpx.post(running.url + CHAT, json=body, timeout=30)
        assert r.status_code == 200, r.text
        ratio = app.endpoint.gw.token_ratio
        assert ratio.ratio("m") == pytest.approx(3.0)
        assert ratio.scaled("m", est) == 3 * est
        # the program was booked at the engine's count, not the estimate
        prog = httpx.get(running.url + "/v1/programs/p1").json()
        assert prog["context_tokens"] == 3 * est + 2
    finally:
        lt.close()
