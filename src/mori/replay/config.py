"""What one replay is: its settings (``ReplayConfig``) and the replay plan they give."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from mori.sim.plan import ReplayPlan
from mori.sim.workload import workload_problems
from mori.traces.model import TraceSet


class ReplaySettingsError(ValueError):
    """The settings cannot be replayed (no program fits the context window)."""


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """One replay. ``target``: the server's base URL (a trailing ``/v1`` is accepted).

    ``max_context`` (trace tokens) None: the model's ``max_model_len`` from
    ``/v1/models`` divided by ``token_scale`` when the target reports one, else no cut.
    ``token_scale`` multiplies every token count sent (prompt, reuse, ``max_tokens``).
    ``model`` None: the first model the target lists. ``request_timeout_s`` and
    ``error_backoff_s`` are wall seconds.
    """

    target: str
    programs: int
    duration_s: float = 3600.0
    time_scale: float = 1.0
    seed: int = 0
    stagger_s: float = 30.0
    human_gap: str = "cap"
    human_gap_cap_s: float = 60.0
    max_context: int | None = None
    model: str | None = None
    text_prompts: bool = False
    token_scale: float = 1.0
    api_key: str = "EMPTY"
    request_timeout_s: float = 300.0
    end_on_error: bool = False
    error_backoff_s: float = 0.1

    def __post_init__(self) -> None:
        problems = []
        for name in ("duration_s", "time_scale", "stagger_s", "human_gap_cap_s", "token_scale",
                     "request_timeout_s", "error_backoff_s"):
            if not math.isfinite(getattr(self, name)):
                problems.append(f"{name} must be a finite number (got {getattr(self, name)})")
        if not self.target.startswith(("http://", "https://")):
            problems.append(f"target must be an http:// or https:// URL (got {self.target!r})")
        problems += workload_problems(self.programs, self.duration_s, self.stagger_s,
                                      self.human_gap, self.human_gap_cap_s, self.max_context)
        if not self.time_scale > 0:
            problems.append(f"time scale must be > 0 (got {self.time_scale})")
        if not self.token_scale > 0:
            problems.append(f"token scale must be > 0 (got {self.token_scale})")
        if not self.request_timeout_s > 0:
            problems.append(f"request timeout must be > 0 seconds (got {self.request_timeout_s})")
        if self.error_backoff_s < 0:
            problems.append(f"error backoff must be >= 0 (got {self.error_backoff_s})")
        if problems:
            raise ValueError("invalid replay settings: " + "; ".join(problems))

    @property
    def base_url(self) -> str:
        """The target without a trailing slash or ``/v1``."""
        url = self.target.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url



def context_limit(cfg: ReplayConfig, max_model_len: int | None) -> int | None:
    """The context window programs are cut at, in trace tokens (None: no cut)."""
    if cfg.max_context is not None:
        return cfg.max_context
    return max(1, int(max_model_len / cfg.token_scale)) if max_model_len else None


def build_plan(cfg: ReplayConfig, traces: TraceSet, max_context: int | None) -> ReplayPlan:
    """The replay plan of ``cfg`` (ReplaySettingsError if no program fits ``max_context``)."""
    max_ctx = sys.maxsize if max_context is None else max_context
    plan = ReplayPlan.build(traces.programs, slots=cfg.programs, seed=cfg.seed,
                            stagger_s=cfg.stagger_s, max_context=max_ctx,
                            human_gap=cfg.human_gap, human_gap_cap_s=cfg.human_gap_cap_s)
    if not plan.programs:
        raise ReplaySettingsError(f"no program of trace set {traces.name!r} fits a context of {max_ctx} "
                         "tokens; raise --max-context or use other traces")
    return plan
