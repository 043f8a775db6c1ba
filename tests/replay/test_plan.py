"""The replay rules shared by the simulator and the replay client (mori.sim.plan)."""

from __future__ import annotations

from mori.sim.config import SimConfig
from mori.sim.plan import ReplayPlan
from mori.sim.runner import Simulation
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet


def four() -> list[ProgramTrace]:
    return [ProgramTrace(f"p{i}", (Step(100 * (i + 1), 5, 50.0, GapKind.TOOL),
                                   Step(100 * (i + 2), 5, 0.0, GapKind.END, 100 * (i + 1))))
            for i in range(4)]


def plan(seed: int = 4, stagger: float = 10.0, slots: int = 3) -> ReplayPlan:
    return ReplayPlan.build(four(), slots=slots, seed=seed, stagger_s=stagger,
                            max_context=100_000, human_gap="cap", human_gap_cap_s=60.0)


def test_order_and_start_times_for_a_seed() -> None:
    # random.Random(4): shuffle([0, 1, 2, 3]) first, then uniform(0, 10) per slot
    p = plan()
    assert p.order == [2, 0, 3, 1]
    assert p.start_times == [7.212169050876664, 4.788783949238976, 0.9010024418320572]
    assert plan(stagger=0.0).start_times == [0.0, 0.0, 0.0]
    assert plan(stagger=0.0).order == [2, 0, 3, 1]  # no draw for the start times


def test_cursor_cycles_and_names_instances() -> None:
    p = plan()
    names = [p.start_slot(s).pid for s in (2, 1, 0, 1, 2)]
    assert names == ["p2#1", "p0#2", "p3#3", "p1#4", "p2#5"]
    child = p.start(four()[0], None)
    assert child.pid == "p0#6" and child.slot is None


def test_step_rules_gap_subagents_and_residual_gap() -> None:
    kid = ProgramTrace("kid", (Step(10, 1, 0.0, GapKind.END),))
    parent = ProgramTrace("par", (
        Step(100, 5, 3.0, GapKind.SUBAGENT, 0, (SubagentSpawn(1.0, kid), SubagentSpawn(2.0, kid))),
        Step(200, 5, 7.0, GapKind.TOOL, 100),
        Step(300, 5, 0.0, GapKind.END, 200)))
    p = ReplayPlan.build([parent], slots=1, seed=0, stagger_s=0.0, max_context=10_000,
                         human_gap="cap", human_gap_cap_s=60.0)
    run = p.start_slot(0)
    nxt = run.advance()
    assert not nxt.end and [s.delay_s for s in nxt.subagents] == [1.0, 2.0]
    assert run.subagent_ended() is None
    assert run.subagent_ended() == 3.0  # the residual gap, after the last subagent
    assert run.current.prompt_tokens == 200
    nxt = run.advance()
    assert not nxt.end and nxt.gap_s == 7.0 and not nxt.subagents
    assert run.advance().end


def test_the_simulator_replays_by_the_plan() -> None:
    cfg = SimConfig(policy="mori", programs=3, seed=4, stagger_s=10.0, duration_s=9.0,
                    hardware="h200-80g-qwen2.5-7b")
    sim = Simulation(cfg, TraceSet("t", tuple(four())))
    assert sim.plan.order == plan().order
    assert sim.plan.start_times == plan().start_times
    sim.run()
    # slots start at 0.90 (slot 2), 4.79 (slot 1), 7.21 (slot 0); each first step's gap
    # is 50 s, so all three are still live
    assert sorted(sim.live) == ["p0#2", "p2#1", "p3#3"]
    assert {pid: live.slot for pid, live in sim.live.items()} == {"p2#1": 2, "p0#2": 1,
                                                                  "p3#3": 0}
