"""What a replica's engine really charges for a recompute and for a reload, learned from
its answers: ``EngineCosts`` (the prices), ``Work`` (what a stretch of engine time was
spent on) and ``CostLearner`` (the fit).

The policy prices its moves by two estimates (``Policy.recompute_s``, ``Policy.reload_s``):
a drop by the recompute of the program's context, a park by its reload from the host tier.
Configured rates (``PolicyConfig.recompute_tok_s``, ``reload_gbps``) are a prior; a real
engine may differ from them many times over (a CPU engine's prefill is ~50x slower than a
GPU's; its host tier's reload costs a fixed 12-30 ms whatever its size, which a rate does
not see).

The gateway cuts each replica's time into stretches, each the engine time of the prefills
whose first bytes ended it (``mori.gateway.engine_prices``), and tells the learner what each
stretch held (``Work``: requests, prompt tokens computed, reloads from the host tier, tokens
reloaded) and how long it took. The learner fits

    seconds = base_s * requests + recompute_per_token_s * computed
              + reload_fixed_s * reloads + reload_per_token_s * reloaded

by least squares over the recent stretches (each older one's weight decays by ``decay``),
pulled towards the prior (ridge: the prior counts as ``prior_weight`` stretches), so that
a price the samples cannot tell (no reload seen yet; tokens that never vary) stays the
prior's. A price is reported once ``min_samples`` stretches held that kind of work; no
price is below zero (a coefficient the fit puts below zero is reported as zero). Pure: no
clock, no I/O; samples in, prices out, in the unit the samples came in (the gateway
converts to policy seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mori.core.linear import solve

__all__ = ["CostLearner", "EngineCosts", "Work"]


@dataclass(frozen=True, slots=True)
class EngineCosts:
    """A replica's prices, in policy seconds: a recompute of ``n`` tokens costs
    ``recompute_per_token_s * n``; a reload of ``n`` tokens from the host tier
    ``reload_fixed_s + reload_per_token_s * n`` (None: not learned yet, the policy keeps
    its configured rate for that move)."""

    recompute_per_token_s: float | None = None
    reload_fixed_s: float | None = None
    reload_per_token_s: float | None = None

    def scaled(self, factor: float) -> EngineCosts:
        """The same prices in another time unit (``factor`` new units per old one)."""
        def s(v: float | None) -> float | None:
            return None if v is None else v * factor
        return EngineCosts(s(self.recompute_per_token_s), s(self.reload_fixed_s),
                           s(self.reload_per_token_s))


@dataclass(frozen=True, slots=True)
class Work:
    """What a stretch of engine time was spent on: ``requests`` prefills, ``computed``
    prompt tokens computed, ``reloads`` of them with KV from the host tier, ``reloaded``
    tokens those found cached."""

    requests: int
    computed: int
    reloads: int = 0
    reloaded: int = 0

    def features(self) -> tuple[float, float, float, float]:
        return (float(self.requests), float(self.computed), float(self.reloads),
                float(self.reloaded))


_N = 4  # base, recompute per token, reload fixed, reload per token


class CostLearner:
    """One replica's learned prices (the module docstring). The priors, per request and
    per token in the samples' unit: ``prior_recompute_per_token_s`` and
    ``prior_reload_per_token_s`` (the configured rates), ``prior_base_s`` and
    ``prior_reload_fixed_s`` (0 unless told)."""

    def __init__(self, prior_recompute_per_token_s: float, prior_reload_per_token_s: float,
                 *, prior_base_s: float = 0.0, prior_reload_fixed_s: float = 0.0,
                 min_samples: int = 16, decay: float = 0.99,
                 prior_weight: float = 2.0) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.prior = (prior_base_s, prior_recompute_per_token_s, prior_reload_fixed_s,
                      prior_reload_per_token_s)
        self.min_samples = min_samples
        self.decay = decay
        self.prior_weight = prior_weight
        self._xx = [[0.0] * _N for _ in range(_N)]
        self._xy = [0.0] * _N
        self._w = 0.0
        self.samples = 0
        self.reload_samples = 0

    def observe(self, work: Work, seconds: float) -> None:
        """A stretch of ``seconds`` of engine time spent on ``work``."""
        if not (seconds >= 0 and math.isfinite(seconds)) or work.requests < 1 \
                or min(work.computed, work.reloads, work.reloaded) < 0:
            return
        x = work.features()
        d = self.decay
        self._w = self._w * d + 1.0
        for i in range(_N):
            self._xy[i] = self._xy[i] * d + x[i] * seconds
            row = self._xx[i]
            for j in range(_N):
                row[j] = row[j] * d + x[i] * x[j]
        self.samples += 1
        if work.reloads:
            self.reload_samples += 1

    def fit(self) -> tuple[float, float, float, float]:
        """(base_s, recompute_per_token_s, reload_fixed_s, reload_per_token_s): the ridge
        fit, each at least 0 (the priors where nothing was seen)."""
        if not self._w:
            return self.prior
        a = [row[:] for row in self._xx]
        b = self._xy[:]
        for j in range(_N):
            # the prior counts as prior_weight stretches of this feature's mean size
            lam = self.prior_weight * max(a[j][j] / self._w, 1e-12)
            a[j][j] += lam
            b[j] += lam * self.prior[j]
        x = solve(a, b)
        if x is None:
            return self.prior
        return (max(0.0, x[0]), max(0.0, x[1]), max(0.0, x[2]), max(0.0, x[3]))

    def costs(self) -> EngineCosts:
        """The prices learned so far (a move with too few samples: None)."""
        if self.samples < self.min_samples:
            return EngineCosts()
        _, recompute, fixed, per_token = self.fit()
        if self.reload_samples < self.min_samples:
            return EngineCosts(recompute_per_token_s=recompute)
        return EngineCosts(recompute, fixed, per_token)

    def view(self) -> dict[str, object]:
        """For ``/v1/replicas``: samples, and the prices in seconds (None: not yet)."""
        c = self.costs()
        return {"samples": self.samples, "reload_samples": self.reload_samples,
                "base_s": self.fit()[0] if self.samples >= self.min_samples else None,
                "recompute_per_token_s": c.recompute_per_token_s,
                "reload_fixed_s": c.reload_fixed_s,
                "reload_per_token_s": c.reload_per_token_s}
