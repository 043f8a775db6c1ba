"""What a replica's engine really charges for a recompute and for a reload, learned from
its answers: ``EngineCosts`` (the prices) and ``CostLearner`` (the fit).

The policy prices its moves by two estimates (``Policy.recompute_s``, ``Policy.reload_s``):
a drop by the recompute of the program's context, a park by its reload from the host tier.
Configured rates (``PolicyConfig.recompute_tok_s``, ``reload_gbps``) are a prior; a real
engine may differ from them many times over (a CPU engine's prefill is ~50x slower than a
GPU's; its host tier's reload costs a fixed 12-30 ms whatever its size, which a rate does
not see). The gateway measures each request it sends to a replica that had no other
request of the gateway in flight (so that the time is the request's own, not a queue's):
the seconds from sending it to its first byte, the prompt tokens the engine computed
(prompt less cached) and whether the program's KV came back from the host tier. From those:

- a request that was not reloaded costs ``base_s + recompute_per_token_s * computed``:
  a least-squares line over the recent samples (each older sample's weight decays by
  ``decay``), so a drop of a program of ``n`` tokens costs ``recompute_per_token_s * n``
  more than keeping it (``base_s`` is paid by every request);
- a reloaded request costs what that line says plus ``reload_fixed_s +
  reload_per_token_s * cached``: a second line, over what the reloaded samples took
  beyond the first line's prediction.

A line is used once it has ``min_samples`` samples with some spread in tokens (else its
slope is the prior's and only its level is learned). Slopes are never below zero and the
fixed part never below zero. Pure: no clock, no I/O; samples in, prices out. All times in
the unit the samples came in (the gateway converts to policy seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CostLearner", "EngineCosts"]


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


class _Line:
    """A weighted least-squares line y = a + b x, older samples decaying by ``decay``."""

    __slots__ = ("decay", "n", "w", "sx", "sy", "sxx", "sxy")

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.n = 0
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n += 1
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    def fit(self, min_spread: float, prior_slope: float) -> tuple[float, float]:
        """(a, b); where the x values hardly differ (their weighted standard deviation
        below ``min_spread``) the slope is ``prior_slope`` and only the level is fitted."""
        mx, my = self.sx / self.w, self.sy / self.w
        var = max(0.0, self.sxx / self.w - mx * mx)
        if math.sqrt(var) < min_spread:
            b = prior_slope
        else:
            b = max(0.0, (self.sxy / self.w - mx * my) / var)
        return my - b * mx, b


class CostLearner:
    """One replica's learned prices (the module docstring). ``prior_recompute_per_token_s``
    and ``prior_reload_per_token_s``: the configured rates, used as the slope where the
    samples cannot tell one."""

    def __init__(self, prior_recompute_per_token_s: float, prior_reload_per_token_s: float,
                 *, min_samples: int = 16, decay: float = 0.98,
                 min_spread_tokens: float = 32.0) -> None:
        if min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {min_samples}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.prior_recompute = prior_recompute_per_token_s
        self.prior_reload = prior_reload_per_token_s
        self.min_samples = min_samples
        self.min_spread = min_spread_tokens
        self._base = _Line(decay)
        self._reload = _Line(decay)
        self._pending: list[tuple[int, int, float]] = []  # reloads before the base line

    @property
    def samples(self) -> tuple[int, int]:
        """(requests not reloaded, reloaded requests) seen."""
        return self._base.n, self._reload.n + len(self._pending)

    def observe(self, computed_tokens: int, cached_tokens: int, seconds: float,
                reloaded: bool) -> None:
        """One request that ran alone: ``computed_tokens`` of its prompt computed,
        ``cached_tokens`` found cached, ``seconds`` from its send to its first byte;
        ``reloaded``: its program's KV was in the host tier when it was sent."""
        if not (seconds >= 0 and math.isfinite(seconds)) or computed_tokens < 0 \
                or cached_tokens < 0:
            return
        if not reloaded:
            self._base.add(float(computed_tokens), seconds)
            if self._pending and self._base.n >= self.min_samples:
                pending, self._pending = self._pending, []
                for c, k, s in pending:
                    self._add_reload(c, k, s)
            return
        if self._base.n < self.min_samples:
            if len(self._pending) < 4 * self.min_samples:
                self._pending.append((computed_tokens, cached_tokens, seconds))
            return
        self._add_reload(computed_tokens, cached_tokens, seconds)

    def _add_reload(self, computed: int, cached: int, seconds: float) -> None:
        a, b = self._base.fit(self.min_spread, self.prior_recompute)
        self._reload.add(float(cached), seconds - (a + b * computed))

    def costs(self) -> EngineCosts:
        """The prices learned so far (a move with too few samples: None)."""
        if self._base.n < self.min_samples:
            return EngineCosts()
        _, b = self._base.fit(self.min_spread, self.prior_recompute)
        if self._reload.n < self.min_samples:
            return EngineCosts(recompute_per_token_s=b)
        d, c = self._reload.fit(self.min_spread, self.prior_reload)
        return EngineCosts(b, max(0.0, d), c)

    def view(self) -> dict[str, object]:
        """For ``/v1/replicas``: samples, and the prices in seconds (None: not yet)."""
        c = self.costs()
        base_n, reload_n = self.samples
        a = (self._base.fit(self.min_spread, self.prior_recompute)[0]
             if base_n >= self.min_samples else None)
        return {"samples": base_n, "reload_samples": reload_n,
                "base_s": a,
                "recompute_per_token_s": c.recompute_per_token_s,
                "reload_fixed_s": c.reload_fixed_s,
                "reload_per_token_s": c.reload_per_token_s}
