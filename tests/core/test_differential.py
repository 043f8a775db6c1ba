"""The optimized policies against the straightforward ones (``reference_policies``).

Both run the same hypothesis-generated worlds, and the whole trace (every observation
and every decision list, in order) must be identical, for every registered policy.
The worlds here are larger than the property tests' so that many programs are held at
once and the passed-over candidates are exercised.
"""

from __future__ import annotations

import pytest
from driver import FakeWorld, ProgramSpec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_policies import reference
from test_properties import FIXED, steps, time_limit, worlds

from mori.core import ordered
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES
from mori.core.policy import PolicyConfig

TENTHS = st.integers(0, 100).map(lambda x: x / 10)


@st.composite
def crowded(draw: st.DrawFn) -> dict[str, object]:
    """Up to 30 programs on up to 4 replicas whose GPUs hold a few of them at once."""
    n = draw(st.integers(6, 30))
    programs = [ProgramSpec(f"p{i}", draw(TENTHS),
                            tuple(draw(st.lists(steps(), min_size=1, max_size=4))))
                for i in range(n)]
    peak = max(p.peak() for p in programs)
    total = sum(p.peak() for p in programs)
    replicas = draw(st.integers(1, 4))
    gpu = draw(st.integers(peak, max(peak, 2 * total // (3 * replicas))))
    return dict(programs=programs, batch=draw(st.booleans()), replicas=replicas, gpu=gpu,
                cpu=draw(st.one_of(st.just(0), st.integers(0, total // replicas))),
                disk=draw(st.one_of(st.just(0), st.integers(0, total // replicas))),
                per_token=1, config=PolicyConfig(
                    tick_s=draw(st.sampled_from([0.5, 2.0, 5.0])),
                    idleness_window=draw(st.integers(1, 5)),
                    binary_threshold=draw(st.sampled_from([0.0, 0.5, 1.0])),
                    page_tokens=1,
                    max_wait_s=draw(st.sampled_from([None, 2.0, 10.0, 3600.0])),
                    spread_by_load=draw(st.booleans())))


def trace(cls: type, w: dict[str, object]) -> list[tuple[float, object]]:
    programs = w["programs"]
    config = w["config"]
    assert isinstance(programs, list) and isinstance(config, PolicyConfig)
    policy = cls(ClusterSpec(int(w["replicas"]), int(w["gpu"]), int(w["cpu"]),  # type: ignore[arg-type]
                             int(w.get("disk", 0))),  # type: ignore[call-overload]
                 int(w["per_token"]), config)  # type: ignore[arg-type]
    world = FakeWorld(policy, programs, time_limit(programs, config.tick_s),
                      batch=bool(w.get("batch", False)))
    world.run()
    return world.trace


def assert_same(name: str, w: dict[str, object]) -> None:
    fast, straight = trace(POLICIES.get(name), w), trace(reference(name), w)
    for i, (a, b) in enumerate(zip(fast, straight, strict=False)):
        assert a == b, f"{name}: entry {i} differs at t={a[0]}: {a[1]!r} != {b[1]!r}"
    assert len(fast) == len(straight)


@pytest.mark.parametrize("name", POLICIES.names())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=crowded())
def test_same_decisions_crowded(name: str, w: dict[str, object]) -> None:
    assert_same(name, w)


@pytest.mark.parametrize("name", POLICIES.names())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=worlds())
def test_same_decisions_small(name: str, w: dict[str, object]) -> None:
    assert_same(name, w)


@pytest.mark.parametrize("name", POLICIES.names())
@pytest.mark.parametrize("world", sorted(FIXED))
def test_same_decisions_fixed(name: str, world: str) -> None:
    assert_same(name, dict(FIXED[world], per_token=1, config=PolicyConfig(page_tokens=1)))


def test_reference_is_the_straightforward_round() -> None:
    # the reference must differ from the optimized class in its round, or the test
    # above would compare a policy with itself
    for name in POLICIES.names():
        ref = reference(name)
        if name in ("smg", "lru-offload"):  # no optimized round: their own code
            assert ref is POLICIES.get(name)
        else:
            assert ref is not POLICIES.get(name) and issubclass(ref, POLICIES.get(name))
            step = "_to_resume" if name.startswith("thunderagent") else "_round"
            assert getattr(ref, step) is not getattr(POLICIES.get(name), step)


def _large_world(seed: int, n: int, replicas: int) -> dict[str, object]:
    """``n`` programs, most held at once, so the candidate index spans many blocks."""
    import random

    from driver import StepSpec

    rng = random.Random(seed)
    programs = []
    for i in range(n):
        steps = tuple(StepSpec(growth=rng.randint(1, 400), output=rng.randint(0, 60),
                               service=rng.choice([0.0, 0.5, 2.0, 7.0]),
                               gap=rng.choice([0.0, 0.3, 4.0, 40.0]),
                               kv_frac=rng.choice([None, 0.5]))
                      for _ in range(rng.randint(1, 5)))
        programs.append(ProgramSpec(f"p{i}", rng.uniform(0.0, 20.0), steps))
    peak = max(p.peak() for p in programs)
    return dict(programs=programs, batch=bool(seed % 2), replicas=replicas,
                gpu=max(peak, 6 * peak // replicas), cpu=(seed % 3) * 2 * peak, per_token=1,
                config=PolicyConfig(tick_s=2.0, page_tokens=1))


@pytest.mark.parametrize("name", ["mori", "mori-pack", "mori-ski", "mori-strict", "mori-yield"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_decisions_many_programs(name: str, seed: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # blocks of 3 candidates: the index splits and merges blocks all the time
    monkeypatch.setattr(ordered, "LOAD", 3)
    assert_same(name, _large_world(seed, 150, 1 + seed))
