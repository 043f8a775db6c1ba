"""The gateway's measure of what each replica's engine charges: ``EnginePrices``.

One ``CostLearner`` (``mori.core.engine_costs``) per replica, fed by the requests that
ran alone on it (``RequestLease.timed``), its priors the policy's configured rates. The
prices are learned in wall seconds and handed to the policy in policy seconds (times
``time_scale``); ``--no-learn-costs`` keeps the configured rates. ``view`` is what
``/v1/replicas`` and the dashboard show.
"""

from __future__ import annotations

import logging
from typing import Any

from mori.core.engine_costs import CostLearner, EngineCosts
from mori.core.policy import DEFAULT_RECOMPUTE_TOK_S, DEFAULT_RELOAD_GBPS, Policy
from mori.gateway.agents import StepFacts

__all__ = ["EnginePrices"]

log = logging.getLogger("mori.gateway")
LOG_EVERY = 500
"""The learned prices are logged once every this many timed requests of a replica."""


def _g(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else "-"


class EnginePrices:
    """Per replica, the engine's learned prices (the module docstring)."""

    def __init__(self, policy: Policy, replicas: int, time_scale: float,
                 learn: bool = True) -> None:
        cfg = policy.config
        recompute_tok_s = cfg.recompute_tok_s or DEFAULT_RECOMPUTE_TOK_S
        gbps = DEFAULT_RELOAD_GBPS if cfg.reload_gbps is None else cfg.reload_gbps
        # the priors, per token in wall seconds (the policy's rates are per policy second)
        recompute = 1.0 / recompute_tok_s / time_scale
        reload = (policy.kv_bytes_per_token / (gbps * 1e9) / time_scale) if gbps > 0 else 0.0
        self.policy = policy
        self.time_scale = time_scale
        self.learn = learn
        self.learners = [CostLearner(recompute, reload) for _ in range(replicas)]

    def observe(self, replica: int, reloaded: bool, step: StepFacts) -> None:
        """A request that ran alone on ``replica`` ended (``step``: its counts and its
        time to first byte); the policy's prices for the replica follow."""
        if step.first_byte_s is None or step.prompt_tokens is None:
            return
        cached = step.cached_tokens or 0
        learner = self.learners[replica]
        learner.observe(max(0, step.prompt_tokens - cached), cached, step.first_byte_s,
                        reloaded)
        if self.learn:
            self.policy.set_engine_costs(replica, learner.costs().scaled(self.time_scale))
        base, reloads = learner.samples
        if (base + reloads) % LOG_EVERY == 0:
            m = learner.view()
            log.info("replica %d: engine prices from %d + %d timed requests: base %s s, "
                     "recompute %s s/token, reload %s s + %s s/token (wall seconds)", replica,
                     base, reloads, _g(m["base_s"]), _g(m["recompute_per_token_s"]),
                     _g(m["reload_fixed_s"]), _g(m["reload_per_token_s"]))

    def view(self, replica: int) -> dict[str, Any]:
        """What was measured on ``replica`` (wall seconds) and the prices the policy uses
        (policy seconds per token, or per reload for the fixed part; None: the
        configured rate)."""
        learned = self.learners[replica].view()
        used = self.policy.engine_costs[replica] if self.learn else None
        used = used or EngineCosts()
        return {"measured": learned, "learning": self.learn,
                "policy_prices": {"recompute_per_token_s": used.recompute_per_token_s,
                                  "reload_fixed_s": used.reload_fixed_s,
                                  "reload_per_token_s": used.reload_per_token_s}}
