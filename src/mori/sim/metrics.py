"""Run metrics: what one simulation measured, with conventional names."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from mori.sim.config import SimConfig

NONDETERMINISTIC_FIELDS = ("wall_s", "policy_time_per_decision_us", "sim_seconds_per_wall_second")
"""Fields measured with the wall clock; every other field is a pure function of the inputs."""


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass(slots=True)
class Counters:
    """Raw counts accumulated during a run."""

    output_tokens: int = 0
    steps: int = 0
    requests: int = 0
    programs_started: int = 0
    programs_finished: int = 0
    ttft: list[float] = field(default_factory=list)
    held: list[float] = field(default_factory=list)
    decisions: int = 0  # decision rounds (calls of ``decide``)
    policy_time_s: float = 0.0
    churn: ChurnCounter = field(default_factory=lambda: ChurnCounter())


class ChurnCounter:
    """Replica switches: a program's step forwarded to another replica than its last."""

    __slots__ = ("_last", "switched", "switches")

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self.switched: set[str] = set()
        self.switches = 0

    def forwarded(self, program_id: str, replica: int) -> bool:
        """Record a forward; True if it is a switch."""
        prev = self._last.get(program_id)
        self._last[program_id] = replica
        if prev is None or prev == replica:
            return False
        self.switches += 1
        self.switched.add(program_id)
        return True

    def ended(self, program_id: str) -> None:
        self._last.pop(program_id, None)


@dataclass(frozen=True, slots=True)
class RunTotals:
    """What every run measures, simulated (``RunResult``) or replayed against a live
    endpoint (``mori.replay.metrics.ReplayResult``): one name, unit and meaning each.

    ``traces``: the trace set's name. ``output_tokens`` and ``steps`` (LLM calls that
    completed), with their rates over the run's duration; ``requests`` sent;
    ``programs_started`` and ``programs_finished``; the time to first token over the
    requests answered within the run (mean and percentiles, seconds; NaN when none);
    ``programs_left_out`` (programs whose first step does not fit the context window);
    ``wall_s``, the wall-clock seconds the run took.
    """

    traces: str
    output_tokens: int
    output_tokens_per_s: float
    steps: int
    steps_per_s: float
    requests: int
    programs_started: int
    programs_finished: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    programs_left_out: int
    wall_s: float


def ttft_stats(ttft: list[float]) -> tuple[float, float, float, float]:
    """Mean, p50, p90 and p99 of ``ttft`` (NaN each when empty)."""
    mean = sum(ttft) / len(ttft) if ttft else math.nan
    return mean, percentile(ttft, 50), percentile(ttft, 90), percentile(ttft, 99)


@dataclass(frozen=True, slots=True)
class RunResult(RunTotals):
    """What one simulated run measured (``RunTotals`` and more), with the run's
    configuration.

    ``traces`` is the trace set's name and ``max_context`` the context length programs
    were cut at, in trace tokens (``config.max_context``, or the model's context window
    divided by ``config.token_scale`` when that is None). Token counts (``prompt_tokens``,
    ``output_tokens``, ...) are the engine's, after the token scale; times are simulated
    seconds, engine durations multiplied by ``config.engine_slowdown``.
    ``gpu_hit_rate`` and ``cpu_hit_rate``: the shares of ``prompt_tokens`` found in the
    GPU pool and reloaded from the CPU tier, ``disk_hit_rate`` the share read back from
    the disk tier (the three sum to the prefix-cached share); ``reloaded_tokens`` counts
    the tokens reloaded from the CPU tier, ``disk_read_tokens`` those read from disk, and
    ``disk_written_bytes`` the KV written to disk.
    The TTFT figures count only requests answered within the run. A request still
    without its first token at the end is counted in ``requests_waiting_at_end``;
    ``wait_max_at_end_s`` is the longest such wait so far, and ``ttft_p99_with_waiting_s``
    the p99 over the answered requests' TTFTs and those waits (a lower bound on what
    they will be): the tail that censoring at the end of the run hides.
    """

    config: SimConfig
    max_context: int
    requests_waiting_at_end: int
    wait_max_at_end_s: float
    ttft_p99_with_waiting_s: float
    held_mean_s: float
    gpu_busy_frac: float
    gpu_busy_frac_per_replica: list[float]
    running_requests_per_replica: list[float]
    churn_programs_frac: float
    switches_per_program: float
    switch_recomputed_tokens: int
    gpu_hit_rate: float
    cpu_hit_rate: float
    disk_hit_rate: float
    prompt_tokens: int
    prefill_tokens: int
    recomputed_tokens: int
    reloaded_tokens: int
    disk_read_tokens: int
    disk_written_bytes: int
    promotions: int
    demotions_to_cpu: int
    demotions_to_disk: int
    demotions_to_none: int
    decisions: int
    policy_time_per_decision_us: float
    gpu_kv_capacity_tokens: int
    cpu_kv_capacity_tokens: int
    disk_kv_capacity_tokens: int
    events: int
    sim_seconds_per_wall_second: float

    def to_dict(self) -> dict[str, Any]:
        """One flat JSON-able record: the run's settings (:func:`settings_dict`), then
        every measurement; NaN and infinity become null."""
        out = settings_dict(self.config, self.traces, self.max_context)
        out.update((f.name, getattr(self, f.name)) for f in fields(self)
                   if f.name not in RESULT_CONTEXT)
        return {k: _json_safe(v) for k, v in out.items()}


RESULT_CONTEXT = ("config", "traces", "max_context")
"""The fields of :class:`RunResult` that describe the run rather than measure it."""


def settings_dict(config: SimConfig, traces: str, max_context: int) -> dict[str, Any]:
    """The settings of a run as a flat result record holds them (see ``RESULT_SETTINGS``).

    ``programs`` counts the programs in all, ``programs_per_replica`` per replica (what
    ``--programs`` gives; derived, not a :class:`SimConfig` field). The policy knobs a
    record carries are ``tick_s``, ``idleness_window``, ``binary_threshold`` and
    ThunderAgent's ``acting_token_weight`` and ``acting_token_decay``, and the
    ``policy_reload_gbps`` (the policy's ``reload_gbps``) and ``recompute_tok_s`` asked
    for (None: the simulated link's and the cost model's), and MORI's ``max_wait_s``, ``load_window_s``, ``fill_idle``,
    ``gpu_overcommit`` and ``gpu_overcommit_max``;
    ``max_context`` is the length programs were cut at (trace tokens); ``gpu_kv_tokens``
    and ``cpu_kv_tokens`` are the overrides asked for (None: none; the pools simulated
    are ``gpu_kv_capacity_tokens`` and ``cpu_kv_capacity_tokens``); ``reload_gbps`` the
    simulated link's reload bandwidth asked for (``SimConfig.reload_gbps``, None: the
    preset's); ``disk_ratio``, ``disk_kv_tokens``
    and ``disk`` the disk tier asked for.
    """
    c, p = config, config.policy_config
    return {"policy": c.policy, "programs": c.programs,
            "programs_per_replica": c.programs_per_replica, "hardware": c.hardware,
            "cpu_ratio": c.cpu_ratio, "replicas": c.replicas, "duration_s": c.duration_s,
            "seed": c.seed, "traces": traces, "human_gap": c.human_gap,
            "human_gap_cap_s": c.human_gap_cap_s, "max_context": max_context,
            "share_prefix": c.share_prefix, "stagger_s": c.stagger_s,
            "gpu_kv_tokens": c.gpu_kv_tokens, "cpu_kv_tokens": c.cpu_kv_tokens,
            "token_scale": c.token_scale, "engine_slowdown": c.engine_slowdown,
            "reload_gbps": c.reload_gbps, "max_output_tokens": c.max_output_tokens,
            "disk_ratio": c.disk_ratio,
            "disk_kv_tokens": c.disk_kv_tokens, "disk": c.disk, "tick_s": p.tick_s,
            "idleness_window": p.idleness_window, "binary_threshold": p.binary_threshold,
            "acting_token_weight": p.acting_token_weight,
            "acting_token_decay": p.acting_token_decay,
            "policy_reload_gbps": p.reload_gbps,
            "max_wait_s": p.max_wait_s, "recompute_tok_s": p.recompute_tok_s,
            "load_window_s": p.load_window_s, "fill_idle": p.fill_idle,
            "gpu_overcommit": p.gpu_overcommit,
            "gpu_overcommit_max": p.gpu_overcommit_max}


RESULT_SETTINGS: tuple[str, ...] = tuple(settings_dict(SimConfig(), "", 0))
"""The keys of a flat result record that hold the run's settings, in record order."""


def _json_safe(v: Any) -> Any:
    """JSON has no NaN or infinity: an empty sample (or a zero wall time) is null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v
