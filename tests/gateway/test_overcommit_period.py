"""The adaptive GPU tier in a gateway (``mori_overcommit`` through ``policy_for``): it
looks at the engines' queues no more often than four of the gateway's readings of them,
in policy seconds; the tier and the engine's pool are in ``/v1/replicas``."""

from __future__ import annotations

import dataclasses

from mori.core.policies import MoriPolicy
from mori.core.policy import PolicyConfig
from mori.engines.base import KVCapacity
from mori.gateway.app import policy_for, tier_tokens
from mori.gateway.config import GatewaySettings

CAP = KVCapacity(gpu_tokens=1000, cpu_tokens=500, page_tokens=10)


def policy(**settings: object) -> MoriPolicy:
    p = policy_for(GatewaySettings(policy="mori", **settings), [CAP])  # type: ignore[arg-type]
    assert isinstance(p, MoriPolicy)
    return p


def adaptive(**knobs: object) -> PolicyConfig:
    return dataclasses.replace(PolicyConfig(), gpu_overcommit_max=8.0, **knobs)  # type: ignore[arg-type]


def test_the_tier_looks_once_per_four_readings_of_the_engines() -> None:
    p = policy(policy_config=adaptive(), load_interval_s=1.0, time_scale=100.0)
    assert p.overcommit is not None and p.overcommit.period_s == 400.0


def test_never_more_often_than_the_load_window() -> None:
    p = policy(policy_config=adaptive(), load_interval_s=0.5, time_scale=1.0)
    assert p.overcommit is not None and p.overcommit.period_s == 60.0


def test_a_period_given_is_kept() -> None:
    p = policy(policy_config=adaptive(gpu_overcommit_period_s=7.0), load_interval_s=1.0,
               time_scale=100.0)
    assert p.overcommit is not None and p.overcommit.period_s == 7.0


def test_a_fixed_tier_has_no_rule_and_shows_its_size() -> None:
    p = policy(policy_config=dataclasses.replace(PolicyConfig(), gpu_overcommit=2.0))
    assert p.overcommit is None
    assert tier_tokens(p, 0) == {"tokens": 2000, "pool_tokens": 1000}
