"""The straightforward policies: the reference the optimized core is checked against.

``mori.core.policies`` avoids work that cannot change a decision (a candidate larger
than every replica's room is passed over without a look at each replica). The classes
here are the same policies with the plain loops they replaced: every candidate tried
on every replica, every held request scanned. ``test_differential`` runs both side by
side and asserts identical decision lists.
"""

from __future__ import annotations

from mori.core.decisions import Decision
from mori.core.policies import POLICIES, MoriPolicy
from mori.core.policies.mori import _Iota
from mori.core.policy import Policy
from mori.core.program import Program
from mori.core.types import Tier


class StraightMori(MoriPolicy):
    """MORI's decision round as first written."""

    def _decide(self, now: float, out: list[Decision]) -> None:
        iota = _Iota(now)
        self._rebalance(now, out, iota)
        self._fix_overflow(out, iota)
        for p in sorted(self._ready.values(), key=lambda q: q.ready_seq):
            if p.tier is Tier.GPU:
                self._forward(p, now, out)
        self._promote_ready(now, out, iota)

    def _level(self, p: Program) -> int:
        if p.tier is Tier.CPU:
            return 0
        return 1 if p.returning else 2

    def _promote_ready(self, now: float, out: list[Decision], iota: _Iota) -> None:
        pl = self.placement
        cap = self.cluster.gpu_bytes
        cands = [p for p in self._ready.values() if p.tier is not Tier.GPU]
        if not cands:
            return
        cands.sort(key=lambda p: (self._level(p), p.tokens if self._level(p) == 2 else 0,
                                  iota(p), p.ready_seq))
        reserve = [0] * len(pl.gpu)
        blocked = False

        def fits_nowhere(c: Program) -> bool:
            return cap is not None and c.kv_bytes > cap

        def place(c: Program, r: int) -> None:
            self._promote(c, r, out)
            self._forward(c, now, out)

        def place_or_make_room(c: Program) -> None:
            nonlocal blocked
            r = self._best_fit(c, reserve)
            if r is not None:
                place(c, r)
            elif not blocked:
                blocked = True
                self._make_room(c, now, out, iota, reserve)

        for c in (c for c in cands if c.tier is Tier.CPU and not fits_nowhere(c)):
            place_or_make_room(c)
        waiting = [c for c in cands if c.tier is Tier.NONE and not fits_nowhere(c)]
        room = sum(max(0.0, gq.free() - reserve[r]) for r, gq in enumerate(pl.gpu))
        batch: list[Program] = []
        for c in waiting:
            if c.kv_bytes > room:
                break
            batch.append(c)
            room -= c.kv_bytes
        placed: set[str] = set()
        order = sorted(batch, key=lambda p: (-p.kv_bytes, p.ready_seq))
        spread = self._spread(order, reserve)
        for c in order:
            r = spread[c.program_id] if spread is not None else self._best_fit(c, reserve)
            if r is not None:
                place(c, r)
                placed.add(c.program_id)
        for c in waiting:
            if c.program_id not in placed:
                place_or_make_room(c)


def reference(name: str) -> type[Policy]:
    """The registered policy ``name`` with the straightforward decision round."""
    cls = POLICIES.get(name)
    for straight in (StraightMori,):
        base = straight.__mro__[1]
        if issubclass(cls, base):
            # the policy's own overrides (ablations, variants) stay; the round is
            # the straightforward one
            return type(f"Reference{cls.__name__}", (_round_of(straight), cls), {})
    return cls  # no optimized round (smg, thunderagent): its own code is the reference


def _round_of(straight: type[Policy]) -> type:
    """A mixin holding only the methods ``straight`` defines itself."""
    own = {k: v for k, v in vars(straight).items() if callable(v)}
    return type(f"{straight.__name__}Round", (), own)
