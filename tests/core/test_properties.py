"""Property tests: every registered policy, driven by random closed-loop worlds.

After every decide: ``check_integrity()`` holds and the decision list replays on a
shadow ledger (``driver.replay``: Forward only for a GPU-resident program that holds a
request, Promote only into room, Demote never of a Reasoning program, nothing placed on
a replica that is down). At the end every request was forwarded exactly once (once more
for each time it failed with its replica) and every program ended: no request lost.
Some worlds have a disk tier, some lose replicas for a while, some start with
programs found on the engines (a restarted gateway), and some price their replicas by
learned engine costs (a measured reload price makes ``mori`` wait before parking), and
some have engines that report requests queued for a while (``mori``'s moves wait then).
"""

from __future__ import annotations

import pytest
from driver import DecisionError, FakeWorld, Liveness, ProgramSpec, StepSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.core.decisions import Decision
from mori.core.engine_costs import EngineCosts
from mori.core.idleness import IdlenessHistory
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES, MoriPolicy, SMGPolicy
from mori.core.policies.thunderagent import FORCE_RESUME_S
from mori.core.policy import Policy, PolicyConfig
from mori.core.types import Tier

TENTHS = st.integers(0, 100).map(lambda x: x / 10)  # ties are likely on a 0.1 s grid


@st.composite
def steps(draw: st.DrawFn) -> StepSpec:
    return StepSpec(
        growth=draw(st.one_of(st.integers(1, 120), st.integers(-60, 300))),
        output=draw(st.integers(0, 60)),
        service=draw(st.one_of(st.just(0.0), TENTHS, st.integers(1, 60).map(float))),
        gap=draw(st.one_of(st.just(0.0), TENTHS, st.integers(10, 600).map(float))),
        kv_frac=draw(st.one_of(st.none(), st.floats(0.0, 0.9))),
    )


@st.composite
def histories(draw: st.DrawFn) -> IdlenessHistory:
    """An idleness history kept across a restart (``--state``)."""
    cycles = draw(st.lists(st.tuples(TENTHS, TENTHS), max_size=6))
    acting = draw(st.booleans())
    return IdlenessHistory(tuple(cycles), draw(TENTHS) if acting else 0.0,
                           draw(TENTHS) if acting else 0.0)


@st.composite
def engine_costs(draw: st.DrawFn) -> EngineCosts:
    """Prices an engine was measured to charge (``Policy.set_engine_costs``)."""
    price = st.none() | st.sampled_from([0.0, 0.01, 0.1, 1.0, 20.0])
    return EngineCosts(draw(price), draw(price), draw(price))


@st.composite
def worlds(draw: st.DrawFn) -> dict[str, object]:
    n = draw(st.integers(1, 8))
    programs = [
        ProgramSpec(f"p{i}", draw(st.one_of(st.just(0.0), TENTHS)),
                    tuple(draw(st.lists(steps(), min_size=1, max_size=5))))
        for i in range(n)
    ]
    page = draw(st.sampled_from([1, 1, 1, 4, 16]))
    per_token = draw(st.sampled_from([1, 1, 2]))
    peak_tokens = max(p.peak() for p in programs)
    peak = -(-peak_tokens // page) * page * per_token  # policy.bytes_for(peak)
    total = sum(-(-p.peak() // page) * page * per_token for p in programs)
    gpu = draw(st.one_of(st.just(peak), st.integers(peak, max(peak, total))))
    cpu = draw(st.one_of(st.just(0), st.integers(0, 2 * total)))
    disk = draw(st.one_of(st.just(0), st.just(0), st.integers(0, 2 * total)))
    replicas = draw(st.integers(1, 3))
    outages = draw(st.lists(st.tuples(st.one_of(TENTHS, TENTHS.map(lambda t: 10 * t)),
                                      st.integers(0, 600),
                                      st.integers(0, replicas - 1)), max_size=3))
    restored = [(p.pid, draw(st.integers(1, p.peak())), draw(st.integers(0, replicas - 1)),
                 draw(st.sampled_from([Tier.GPU, Tier.CPU])), draw(st.none() | histories()))
                for p in programs if draw(st.integers(0, 3)) == 0]
    queues = draw(st.lists(st.tuples(st.one_of(TENTHS, TENTHS.map(lambda t: 10 * t)),
                                     st.integers(0, replicas - 1), st.integers(0, 3)),
                           max_size=4))
    return dict(
        programs=programs,
        outages=[(at, at + span / 10, r) for at, span, r in outages],
        queues=queues,
        restored=restored,
        batch=draw(st.booleans()),
        replicas=replicas,
        costs=[draw(st.none() | engine_costs()) for _ in range(replicas)],
        gpu=gpu,
        cpu=cpu,
        disk=disk,
        per_token=per_token,
        config=PolicyConfig(
            tick_s=draw(st.sampled_from([0.5, 2.0, 5.0])),
            idleness_window=draw(st.integers(1, 5)),
            binary_threshold=draw(st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0])),
            page_tokens=page,
            gpu_overcommit=draw(st.sampled_from([1.0, 1.0, 1.5, 3.0])),
            gpu_overcommit_max=draw(st.sampled_from([1.0, 1.0, 4.0])),
            load_window_s=draw(st.sampled_from([60.0, 60.0, 2.0])),
        ),
    )


def time_limit(programs: list[ProgramSpec], tick: float) -> float:
    """Long enough for every program to finish under every policy: ThunderAgent may hold
    a step until its forced resume (where its 100-token buffer per program never fits
    these worlds' tiny GPUs)."""
    work = sum(s.service + s.gap for p in programs for s in p.steps)
    steps = sum(len(p.steps) for p in programs)
    return (max(p.start for p in programs) + 4 * work + 100 * tick + 1000.0
            + steps * (FORCE_RESUME_S + 2 * tick))


def run_world(name: str, w: dict[str, object]) -> FakeWorld:
    programs = w["programs"]
    config = w["config"]
    assert isinstance(programs, list) and isinstance(config, PolicyConfig)
    policy = POLICIES.get(name)(
        ClusterSpec(int(w["replicas"]), int(w["gpu"]), int(w["cpu"]),  # type: ignore[arg-type]
                    int(w.get("disk", 0))),  # type: ignore[call-overload]
        int(w["per_token"]), config)  # type: ignore[arg-type]
    for r, costs in enumerate(w.get("costs", [])):  # type: ignore[arg-type]
        if costs is not None:
            policy.set_engine_costs(r, costs)
    outages = list(w.get("outages", []))  # type: ignore[call-overload]
    limit = time_limit(programs, config.tick_s) + sum(up - down for down, up, _ in outages)
    world = FakeWorld(policy, programs, limit, batch=bool(w.get("batch", False)),
                      outages=outages,
                      restored=list(w.get("restored", [])),  # type: ignore[call-overload]
                      queues=list(w.get("queues", [])))  # type: ignore[call-overload]
    world.run()
    return world


@pytest.mark.parametrize("name", POLICIES.names())
@settings(max_examples=120, deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.too_slow])
@given(w=worlds())
def test_no_request_lost(name: str, w: dict[str, object]) -> None:
    run_world(name, w)


# -- a few fixed worlds that exercise the edges ------------------------------------------------
def _prog(pid: str, start: float, *spec: tuple[int, int, float, float]) -> ProgramSpec:
    return ProgramSpec(pid, start, tuple(StepSpec(g, o, s, gap, 0.5) for g, o, s, gap in spec))


FIXED = {
    # every program needs the whole GPU: strictly one at a time
    "serial": dict(programs=[_prog(f"p{i}", 0.0, (50, 50, 1.0, 3.0), (0, 0, 1.0, 0.0))
                             for i in range(4)], replicas=1, gpu=100, cpu=0),
    # zero service and zero gaps: idleness 1.0 and 0.0 on the same instant
    "instant": dict(programs=[_prog(f"p{i}", 0.0, (30, 10, 0.0, 0.0), (10, 10, 0.0, 0.0),
                                    (10, 10, 0.0, 0.0)) for i in range(5)],
                    replicas=2, gpu=100, cpu=100),
    # one long tool call among busy programs, a shrinking context
    "mixed": dict(programs=[_prog("long", 0.0, (40, 10, 1.0, 300.0), (0, 10, 1.0, 0.0)),
                            _prog("busy", 0.5, *[(5, 5, 2.0, 0.1)] * 5),
                            _prog("shrink", 1.0, (80, 10, 1.0, 1.0), (-70, 5, 1.0, 1.0)),
                            _prog("late", 50.0, (90, 0, 3.0, 0.0))],
                  replicas=1, gpu=100, cpu=60),
}


@pytest.mark.parametrize("name", POLICIES.names())
@pytest.mark.parametrize("world", sorted(FIXED))
def test_fixed_worlds(name: str, world: str) -> None:
    w = dict(FIXED[world], per_token=1, config=PolicyConfig(page_tokens=1))
    run_world(name, w)


# -- the driver catches broken policies ---------------------------------------------------------
class _Forgetful(SMGPolicy):
    """Never forwards a program's second request."""

    def _decide(self, now: float, out: list[Decision]) -> None:
        for p in sorted(self._ready.values(), key=lambda q: q.ready_seq):
            if p.steps_done >= 1:
                continue
            if p.tier is not Tier.GPU:
                self._promote(p, 0, out)
            self._forward(p, now, out)


class _ForwardFirst(SMGPolicy):
    """Emits the Forward before the Promote."""

    def _decide(self, now: float, out: list[Decision]) -> None:
        for p in list(self._ready.values()):
            mark = len(out)
            if p.tier is not Tier.GPU:
                self._promote(p, 0, out)
            self._forward(p, now, out)
            out[mark:] = out[mark:][::-1]


class _Overfull(MoriPolicy):
    """Promotes everything onto replica 0, room or not."""

    def _decide(self, now: float, out: list[Decision]) -> None:
        for p in list(self._ready.values()):
            if p.tier is not Tier.GPU:
                self._promote(p, 0, out)
            self._forward(p, now, out)


class _DemotesReasoning(MoriPolicy):
    """Drops a Reasoning program's KV to make room at once."""

    def _decide(self, now: float, out: list[Decision]) -> None:
        for p in list(self._ready.values()):
            if p.tier is not Tier.GPU:
                gq = self.placement.gpu[0]
                for pid in list(gq.members):
                    if not gq.fits(p.kv_bytes):
                        self._demote_to(self.programs[pid], Tier.NONE, None, out)
                self._promote(p, 0, out)
            self._forward(p, now, out)


BROKEN = [(_Forgetful, Liveness), (_ForwardFirst, DecisionError), (_Overfull, DecisionError),
          (_DemotesReasoning, DecisionError)]


@pytest.mark.parametrize("cls,error", BROKEN, ids=[c.__name__ for c, _ in BROKEN])
def test_driver_catches_broken_policy(cls: type[Policy], error: type[Exception]) -> None:
    programs = [_prog(f"p{i}", 0.1 * i, (60, 10, 5.0, 1.0), (10, 10, 1.0, 0.0))
                for i in range(3)]
    policy = cls(ClusterSpec(1, 100, 100), 1, PolicyConfig(page_tokens=1))
    with pytest.raises(error):
        FakeWorld(policy, programs, time_limit(programs, 5.0)).run()
