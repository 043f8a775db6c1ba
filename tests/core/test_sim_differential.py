"""The simulator with the optimized policies against the straightforward ones.

A whole simulation (engines, closed-loop workload, metrics) must come out the same
whether its policy keeps its indexes up to date (``mori.core.policies``) or scans and
sorts everything each round (``reference_policies``): every metric but the wall time
and the policy's CPU time, and every executed decision in order.
"""

from __future__ import annotations

import pytest
from reference_policies import reference

from mori.core.decision_log import DecisionLog
from mori.core.ledger import ClusterSpec
from mori.sim.config import SimConfig
from mori.sim.runner import Simulation
from mori.traces import default_traces

TIMING = {"wall_s", "sim_seconds_per_wall_second", "policy_time_per_decision_us"}


def run(config: SimConfig, straight: bool) -> tuple[dict[str, object], list[object]]:
    log = DecisionLog()
    sim = Simulation(config, default_traces(), log=log)
    if straight:
        pol = sim.policy
        gpu, cpu = sim.gpu_pages, sim.cpu_pages
        page = sim.cost.preset.page_tokens
        cluster = ClusterSpec(config.replicas, gpu * page * sim.kv_bytes, cpu * page * sim.kv_bytes)
        sim.policy = reference(config.policy)(cluster, sim.kv_bytes, pol.config)
    result = sim.run().to_dict()
    decided = [(r.time, r.decision) for r in log]
    return {k: v for k, v in result.items() if k not in TIMING}, decided


@pytest.mark.parametrize("policy", ["mori", "mori-pack", "mori-ski", "mori-yield",
                                    "thunderagent+offload"])
@pytest.mark.parametrize("replicas,programs,cpu", [(1, 60, 1.0), (3, 90, 2.0)])
def test_same_run_as_the_straightforward_policy(policy: str, replicas: int, programs: int,
                                                cpu: float) -> None:
    config = SimConfig(policy=policy, programs=programs, replicas=replicas, cpu_ratio=cpu,
                       duration_s=900.0, seed=1)
    fast, fast_log = run(config, straight=False)
    slow, slow_log = run(config, straight=True)
    assert fast == slow
    assert fast_log == slow_log
    assert fast["steps"] > 100 and fast["promotions"] > 0  # a run with something to decide
