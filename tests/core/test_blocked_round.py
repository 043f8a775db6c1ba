"""A round ``IndexedPromotion.blocked`` (``mori_promote``) finds blocked decides nothing when run in full.

The round skips its walk when the first CPU candidate cannot be placed and nothing
else can move. Here the skip is disabled and every round runs in full; whenever the
check would have skipped it, the full round must add no decision and leave the index,
the sums and the room order as it found them. ``test_differential`` compares the
decisions with the skip in place against the plain round; this checks the skip's own
claim on every round of the same worlds, including those whose decisions the plain
round would reach by another path.
"""

from __future__ import annotations

import pytest
from driver import FakeWorld
from hypothesis import HealthCheck, given, settings
from test_differential import _large_world, crowded
from test_properties import time_limit

from mori.core import ordered
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES, MoriPolicy
from mori.core.policies.mori_promote import IndexedPromotion
from mori.core.policies.mori_round import Round
from mori.core.policy import PolicyConfig

NAMES = ["mori", "mori-ski", "mori-pack", "mori-yield"]


def checked(name: str) -> type[MoriPolicy]:
    base = POLICIES.get(name)
    assert issubclass(base, MoriPolicy)

    class Checked(base):  # type: ignore[valid-type, misc]
        claimed = 0  # rounds the check found blocked
        rounds = 0

        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            self.promotion.run = self._checked_run  # type: ignore[method-assign]

        def _state(self) -> object:
            return (self.book.index.entries(), list(self.book.avail), set(self.book.open),
                    list(self.book.sums.acting), list(self.book.sums.reasoning),
                    self.book.sums.gpu_used, [gq.used for gq in self.placement.gpu])

        def _checked_run(self, rnd: Round) -> None:
            promotion = self.promotion
            out = rnd.out
            self.book.flush()
            first = self.book.index.cpu_all.first()
            blocked = (rnd.held_for is None and len(self.book.index) > 0 and first is not None
                       and IndexedPromotion.blocked(promotion, first[1], first[2]))
            before, n = self._state(), len(out)
            promotion.blocked = lambda kv, c: False  # type: ignore[method-assign]
            try:
                IndexedPromotion.run(promotion, rnd)  # type: ignore[arg-type]
            finally:
                del promotion.blocked
            type(self).rounds += 1
            if blocked:
                type(self).claimed += 1
                assert out[n:] == [], f"a blocked round decided {out[n:]}"
                self.book.flush()
                assert self._state() == before, "a blocked round changed the state"

    return Checked


def run(cls: type[MoriPolicy], w: dict[str, object]) -> None:
    programs, config = w["programs"], w["config"]
    assert isinstance(programs, list) and isinstance(config, PolicyConfig)
    policy = cls(ClusterSpec(int(w["replicas"]), int(w["gpu"]), int(w["cpu"])),  # type: ignore[arg-type]
                 int(w["per_token"]), config)  # type: ignore[arg-type]
    FakeWorld(policy, programs, time_limit(programs, config.tick_s),
              batch=bool(w.get("batch", False))).run()


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=crowded())
def test_blocked_round_decides_nothing(name: str, w: dict[str, object]) -> None:
    run(checked(name), w)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [1, 2, 4, 5])  # worlds with a CPU tier (seed % 3)
def test_blocked_round_many_programs(name: str, seed: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ordered, "LOAD", 3)
    cls = checked(name)
    run(cls, _large_world(seed, 150, 1 + seed))
    assert cls.claimed > 0, f"no round of {cls.rounds} was found blocked"
