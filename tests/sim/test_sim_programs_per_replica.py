"""``SimConfig.programs`` counts programs in all; ``programs_per_replica`` is what the
command line's ``--programs`` gives."""

from __future__ import annotations

from mori.sim.config import SimConfig
from mori.sim.metrics import RESULT_SETTINGS
from mori.sim.runner import Simulation, simulate
from mori.traces import default_traces


def test_programs_per_replica_is_programs_over_replicas() -> None:
    assert SimConfig(programs=60, replicas=3).programs_per_replica == 20
    assert isinstance(SimConfig(programs=60, replicas=3).programs_per_replica, int)
    assert SimConfig(programs=7, replicas=2).programs_per_replica == 3.5  # said as it is
    assert SimConfig(programs=5).programs_per_replica == 5


def test_a_run_has_programs_slots_over_all_replicas() -> None:
    cfg = SimConfig(policy="smg", programs=6, replicas=2, duration_s=60.0)
    assert len(Simulation(cfg, default_traces()).plan.start_times) == 6  # one per slot
    r = simulate(cfg, default_traces())
    assert r.programs_started >= 6
    row = r.to_dict()
    assert (row["programs"], row["programs_per_replica"], row["replicas"]) == (6, 3, 2)
    assert RESULT_SETTINGS[:3] == ("policy", "programs", "programs_per_replica")
