"""The gateway's measure of what each replica's engine charges: ``EnginePrices``.

Each replica's time is cut into stretches by the first bytes of the gateway's requests
(``PrefillClock``): a request's prefill starts when it is sent or when the engine's
previous prefill ended (its first byte), whichever is later, and ends with its own first
byte: the engine is taken to prefill in the order it was sent (first come, first served,
as vLLM and SGLang schedule waiting requests). First bytes that come within ``merge_s``
of each other ended one engine step that prefilled them together: they make one stretch.
When every request of a stretch has ended, its ``Work`` (requests, tokens computed,
reloads from the host tier and the tokens they found cached, from the engine's usage)
and its seconds go to the replica's ``CostLearner`` (``mori.core.engine_costs``), whose
priors are the policy's configured rates. Approximate, and said so: other clients'
requests, and the decode steps of the gateway's own after their first byte, share the
engine unseen; a stretch with a failed request is left out.

The prices are learned in wall seconds and handed to the policy in policy seconds (times
``time_scale``); ``--no-learn-costs`` keeps the configured rates. ``view`` is what
``/v1/replicas`` shows.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from mori.core.engine_costs import CostLearner, EngineCosts, Work
from mori.core.policy import DEFAULT_RECOMPUTE_TOK_S, DEFAULT_RELOAD_GBPS, Policy
from mori.gateway.agents import StepFacts

__all__ = ["EnginePrices", "PrefillClock", "Stretch"]

log = logging.getLogger("mori.gateway")
LOG_EVERY = 500
"""The learned prices are logged once every this many stretches of a replica."""
MERGE_S = 0.003
"""First bytes closer than this ended the same engine step."""


class Stretch:
    """Engine time that ended with one or more first bytes (``PrefillClock``)."""

    __slots__ = ("start", "end", "members", "reported", "work", "closed", "spoiled")

    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.end = end
        self.members = 1
        self.reported = 0
        self.work = Work(0, 0)
        self.closed = False
        self.spoiled = False

    def add(self, computed: int, cached: int, reloaded: bool) -> None:
        w = self.work
        self.work = Work(w.requests + 1, w.computed + computed, w.reloads + reloaded,
                         w.reloaded + (cached if reloaded else 0))
        self.reported += 1

    @property
    def complete(self) -> bool:
        return self.closed and not self.spoiled and self.reported == self.members


class PrefillClock:
    """One replica's stretches (the module docstring)."""

    def __init__(self, merge_s: float = MERGE_S) -> None:
        self.merge_s = merge_s
        self.last_end = -math.inf
        self.open: Stretch | None = None

    def answered(self, sent: float, at: float) -> tuple[Stretch, Stretch | None]:
        """A request sent at ``sent`` got its first byte at ``at``: its stretch, and the
        one this closed (None: none)."""
        s = self.open
        if s is not None and at - s.end <= self.merge_s and sent <= s.end:
            s.members += 1
            s.end = max(s.end, at)
            self.last_end = max(self.last_end, at)
            return s, None
        closed = s
        if closed is not None:
            closed.closed = True
        s = Stretch(max(sent, self.last_end), at)
        self.open = s
        self.last_end = max(self.last_end, at)
        return s, closed


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
        self.clocks = [PrefillClock() for _ in range(replicas)]

    def answered(self, replica: int, sent: float, at: float) -> Stretch:
        """A request sent to ``replica`` at ``sent`` (wall) got its first byte at
        ``at``; what it returns is handed back to ``ended``."""
        stretch, closed = self.clocks[replica].answered(sent, at)
        if closed is not None and closed.complete:
            self._learn(replica, closed)
        return stretch

    def ended(self, replica: int, stretch: Stretch, reloaded: bool,
              step: StepFacts | None) -> None:
        """A request of ``stretch`` ended; ``step``: its usage (None: it failed, and the
        stretch is left out); ``reloaded``: its program's KV was in the host tier."""
        if step is None or step.prompt_tokens is None:
            stretch.spoiled = True
            return
        cached = step.cached_tokens or 0
        stretch.add(max(0, step.prompt_tokens - cached), cached, reloaded)
        if stretch.complete:
            self._learn(replica, stretch)

    def _learn(self, replica: int, s: Stretch) -> None:
        s.spoiled = True  # counted once
        learner = self.learners[replica]
        learner.observe(s.work, s.end - s.start)
        if self.learn:
            self.policy.set_engine_costs(replica, learner.costs().scaled(self.time_scale))
        if learner.samples % LOG_EVERY == 0:
            m = learner.view()
            log.info("replica %d: engine prices from %d stretches (%d with reloads): base "
                     "%s s, recompute %s s/token, reload %s s + %s s/token (wall seconds)",
                     replica, m["samples"], m["reload_samples"], _g(m["base_s"]),
                     _g(m["recompute_per_token_s"]), _g(m["reload_fixed_s"]),
                     _g(m["reload_per_token_s"]))

    def view(self, replica: int) -> dict[str, Any]:
        """What was measured on ``replica`` (wall seconds) and the prices the policy uses
        (policy seconds per token, or per reload for the fixed part; None: the
        configured rate)."""
        learned = self.learners[replica].view()
        used = (self.policy.engine_costs[replica] if self.learn else None) or EngineCosts()
        return {"measured": learned, "learning": self.learn,
                "policy_prices": {"recompute_per_token_s": used.recompute_per_token_s,
                                  "reload_fixed_s": used.reload_fixed_s,
                                  "reload_per_token_s": used.reload_per_token_s}}


def _g(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else "-"
