"""The engines' reported load: read from their ``/metrics``, shown in ``/healthz`` and
``/metrics``, and (with ``spread_by_load``) weighed where MORI spreads new programs."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from gateway_harness import LoopThread, serve_on_simulated

from mori.core.policy import PolicyConfig
from mori.engines.base import EngineLoad
from mori.engines.http import load_from_metrics
from mori.gateway.config import GatewaySettings
from mori.gateway.replicas import Replica, Replicas

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
"""


def test_load_read_from_each_engines_metrics() -> None:
    assert load_from_metrics(VLLM_METRICS, "vllm:num_requests_running",
                             "vllm:num_requests_waiting") == EngineLoad(5, 4)
    sglang = ("sglang:num_running_reqs{model_name=\"a b\"} 7\n"
              "sglang:num_queue_reqs{model_name=\"a b\"} 1 1700000000000\n")
    assert load_from_metrics(sglang, "sglang:num_running_reqs",
                             "sglang:num_queue_reqs") == EngineLoad(7, 1)
    plain = "mori_engine_requests_running 2\nmori_engine_requests_waiting 0\n"
    assert load_from_metrics(plain, "mori_engine_requests_running",
                             "mori_engine_requests_waiting") == EngineLoad(2, 0)
    # one gauge missing, or unreadable: no reading
    assert load_from_metrics("vllm:num_requests_running 3\n", "vllm:num_requests_running",
                             "vllm:num_requests_waiting") is None
    assert load_from_metrics("a NaN\nb x\n", "a", "b") is None
    assert load_from_metrics("a +Inf\nb 1\n", "a", "b") is None


def test_foreign_load_is_what_the_engine_serves_beyond_the_gateways_requests() -> None:
    r = Replica(0, adapter=None)  # type: ignore[arg-type]
    r.in_flight = 2
    assert r.foreign_load == 0  # no reading
    r.engine_load = EngineLoad(running=5, waiting=3)
    assert r.foreign_load == 6  # 8 on the engine, 2 of them the gateway's
    r.in_flight = 9
    assert r.foreign_load == 0  # sent since the reading


def test_the_engines_waiting_counts_reach_the_policy_as_read() -> None:
    """``Replicas.engine_waiting``: each engine's latest waiting count, None where no
    reading; what ``Controller.decide`` hands the policy (``Policy.set_engine_queues``)."""
    reps = Replicas([None, None, None], health_interval_s=1.0)  # type: ignore[list-item]
    reps[0].engine_load = EngineLoad(running=1, waiting=3)
    reps[2].engine_load = EngineLoad(running=2, waiting=0)
    assert reps.engine_waiting() == [3, None, 0]


@pytest.mark.parametrize("spread_by_load", [True, False])
def test_a_new_program_goes_where_the_engine_serves_fewer(loop_thread: LoopThread,
                                                           spread_by_load: bool) -> None:
    """Engine 0 serves a long request from another client; a new program arriving at
    the gateway goes to engine 1 with ``spread_by_load`` (to 0 without: both are empty
    of MORI's programs, the lowest index)."""
    settings = GatewaySettings(policy_config=PolicyConfig(spread_by_load=spread_by_load),
                               load_interval_s=0.05)
    sg = serve_on_simulated(loop_thread, settings, replicas=2)
    model = openai.OpenAI(base_url=sg.url + "/v1", api_key="x").models.list().data[0].id
    other = openai.OpenAI(base_url=sg.adapters[0].url + "/v1", api_key=sg.engines[0].token,
                          max_retries=0)  # the embedded engine takes only its token
    stream = other.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a long answer, please"}],
        max_tokens=20_000, stream=True)
    try:
        next(iter(stream))  # running on engine 0 now
        deadline = time.monotonic() + 10
        while True:
            rows = httpx.get(sg.url + "/healthz").json()["replicas"]
            if rows[0]["engine_load"] and rows[0]["engine_load"]["running"] >= 1:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(0.05)
        assert rows[1]["engine_load"] == {"running": 0, "waiting": 0}
        gw = openai.OpenAI(base_url=sg.url + "/v1", api_key="x")
        gw.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=2, extra_body={"program_id": "fresh"})
        where = httpx.get(sg.url + "/v1/programs/fresh").json()["replica"]
        assert where == (1 if spread_by_load else 0)
        # the engine's count as last read (every 0.05 s): a reading taken while "fresh"
        # ran on engine 0 counts it too, so wait for one taken after it ended
        want = 'mori_replica_engine_requests{replica="0",state="running"} 1.0'
        deadline = time.monotonic() + 10
        while want not in (metrics := httpx.get(sg.url + "/metrics").text):
            assert time.monotonic() < deadline, [
                line for line in metrics.splitlines()
                if line.startswith("mori_replica_engine_requests")]
            time.sleep(0.05)
    finally:
        stream.close()
