"""bench/ta_churn.py: its counts of ThunderAgent's pauses and resumes are consistent with
the run they watch, and watching changes no decision."""

from __future__ import annotations

from types import ModuleType

import pytest

from bench import ta_churn
from mori.sim.config import SimConfig
from mori.sim.runner import Simulation
from mori.traces import default_traces


@pytest.fixture(scope="module")
def churn() -> ModuleType:
    return ta_churn


def test_counts_match_the_decisions_and_change_none(churn: ModuleType) -> None:
    config = SimConfig(policy="thunderagent+offload", programs=30, replicas=3,
                       duration_s=900.0)
    plain = Simulation(config, default_traces()).run()
    sim = Simulation(config, default_traces())
    seen = churn.count(sim)
    watched = sim.run()
    assert watched.to_dict() | {"wall_s": 0, "sim_seconds_per_wall_second": 0,
                                "policy_time_per_decision_us": 0} == \
        plain.to_dict() | {"wall_s": 0, "sim_seconds_per_wall_second": 0,
                           "policy_time_per_decision_us": 0}
    assert seen["pauses"] > 0 and seen["resumed on another backend"] > 0
    # every pause is a demotion to no tier; every resume or first placement a promotion
    assert seen["pauses"] == watched.demotions_to_none
    assert (seen["first placements"] + seen["resumed on the same backend"]
            + seen["resumed on another backend"]) == watched.promotions
    with pytest.raises(AssertionError, match="thunderagent"):
        churn.count(Simulation(SimConfig(policy="mori", programs=2, duration_s=10.0),
                               default_traces()))
