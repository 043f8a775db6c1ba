"""Scraping a MORI gateway's counters, and the result's JSON form."""

from __future__ import annotations

import math

import pytest

from mori.replay.metrics import (
    GatewayCounters,
    gateway_counters,
    is_gateway_metrics,
    parse_prometheus,
)
from mori.sim.metrics import ttft_stats

GATEWAY_PAGE = """\
# HELP mori_held_requests_total Requests that had to wait for GPU residency
# TYPE mori_held_requests_total counter
mori_held_requests_total 7.0
# HELP mori_held_requests_created Requests that had to wait for GPU residency
# TYPE mori_held_requests_created gauge
mori_held_requests_created 1.7e+09
# HELP mori_promotions_total Programs moved to a GPU tier, by where their KV was
# TYPE mori_promotions_total counter
mori_promotions_total{source="none"} 12.0
mori_promotions_total{source="cpu"} 3.0
# HELP mori_demotions_total Programs moved off a GPU or CPU tier, by destination
# TYPE mori_demotions_total counter
mori_demotions_total{to="cpu"} 4.0
"""

ENGINE_PAGE = """\
# TYPE mori_engine_requests_running gauge
mori_engine_requests_running 3
vllm:num_requests_running{model_name="m"} 3
"""


def test_gateway_counters_from_a_prometheus_page() -> None:
    assert gateway_counters(GATEWAY_PAGE) == GatewayCounters(
        promotions=15, demotions_to_cpu=4, demotions_to_none=0, held_requests=7)
    assert is_gateway_metrics(GATEWAY_PAGE)


def test_demotions_to_a_disk_tier_are_counted_where_the_gateway_has_one() -> None:
    page = GATEWAY_PAGE + 'mori_demotions_total{to="disk"} 9.0\n'
    counters = gateway_counters(page)
    assert (counters.demotions_to_cpu, counters.demotions_to_disk) == (4, 9)
    assert gateway_counters(GATEWAY_PAGE).demotions_to_disk is None  # no disk tier


def test_an_engine_page_is_not_a_gateway() -> None:
    assert not is_gateway_metrics(ENGINE_PAGE)
    assert gateway_counters(ENGINE_PAGE) == GatewayCounters()
    assert parse_prometheus(ENGINE_PAGE)["vllm:num_requests_running"] == [
        ({"model_name": "m"}, 3.0)]


def test_ttft_stats() -> None:
    assert ttft_stats([1.0, 2.0, 3.0, 4.0]) == pytest.approx((2.5, 2.5, 3.7, 3.97))
    assert all(math.isnan(x) for x in ttft_stats([]))
