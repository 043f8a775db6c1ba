"""What a replay measured, from the client's side, with ``mori simulate``'s names.

Times are in *simulated* seconds: wall seconds x ``time_scale``, the factor the gateway
and the simulated engines run at, so a replay's numbers compare with a simulation's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mori.engines.http import parse_prometheus
from mori.sim.metrics import RunTotals

GATEWAY_METRICS = ("mori_promotions_total", "mori_demotions_total", "mori_held_requests_total")
"""The gateway counters a replay scrapes from ``/metrics`` at its end."""


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the client saw it, independent of any scheduling decision.

    Times in simulated seconds since the start of the replay. ``first_token_s`` is None
    when no token arrived; ``end_s`` None when the run ended with the request in flight;
    ``error`` the error kind (see :attr:`ReplayResult.errors`) or None.
    ``prompt_tokens`` and ``cached_tokens``: the server's usage (``prompt_tokens``,
    ``prompt_tokens_details.cached_tokens``) when it reported them, else None.
    """

    program_id: str
    step: int
    sent_s: float
    first_token_s: float | None
    end_s: float | None
    output_tokens: int = 0
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class GatewayCounters:
    """Counters scraped from a MORI gateway's ``/metrics`` (None: not exposed)."""

    promotions: int | None = None
    demotions_to_cpu: int | None = None
    demotions_to_none: int | None = None
    held_requests: int | None = None
    demotions_to_disk: int | None = None  # None also where the replicas have no disk tier


@dataclass(frozen=True, slots=True)
class ReplayResult(RunTotals):
    """One replay: its settings and what the client measured (``RunTotals``, the fields
    every run measures, simulated or replayed, and more).

    ``errors``: failed requests by kind: ``http_<status>`` (an error answer),
    ``connection`` (refused or broken), ``timeout`` (no answer within the request
    timeout), ``stream`` (an error event or a broken stream), ``other``. A failed request
    is not a step. ``release_errors``: failed release calls (not counted in ``errors``).
    """

    target: str
    model: str
    gateway: bool
    programs: int
    duration_s: float
    time_scale: float
    seed: int
    stagger_s: float
    human_gap: str
    human_gap_cap_s: float
    max_context: int | None
    text_prompts: bool
    token_scale: float
    errors: dict[str, int]
    error_count: int
    release_errors: int
    promotions: int | None
    demotions_to_cpu: int | None
    demotions_to_none: int | None
    held_requests: int | None
    demotions_to_disk: int | None = None
    events: tuple[RequestRecord, ...] = field(default=(), repr=False)

    def to_dict(self, events: bool = False) -> dict[str, Any]:
        """The fields as JSON-ready values (NaN and infinity as None); the per-request
        ``events`` only when asked for."""
        d = {k: _json_safe(v) for k, v in asdict(self).items() if k != "events"}
        if events:
            d["events"] = [asdict(e) for e in self.events]
        return d


def _json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_json_safe(x) for x in v]
    return v


def declared_families(text: str) -> set[str]:
    """Metric families a ``# TYPE`` line declares (with and without ``_total``)."""
    out: set[str] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[:2] == ["#", "TYPE"]:
            name = parts[2]
            out.update({name, name.removesuffix("_total"), name + "_total"})
    return out


def is_gateway_metrics(text: str) -> bool:
    """True if a ``/metrics`` page has any of MORI's gateway counters."""
    samples = parse_prometheus(text)
    return any(n in samples for n in GATEWAY_METRICS) or bool(
        declared_families(text) & set(GATEWAY_METRICS))


def gateway_counters(text: str) -> GatewayCounters:
    """MORI's gateway counters from a ``/metrics`` page: 0 for a declared counter with no
    sample yet (a labelled counter nothing has incremented), None for one absent."""
    samples = parse_prometheus(text)
    declared = declared_families(text)

    def total(name: str, **match: str) -> int | None:
        found = [v for labels, v in samples.get(name, [])
                 if all(labels.get(k) == want for k, want in match.items())]
        if found:
            return int(sum(found))
        return 0 if name in declared else None

    return GatewayCounters(
        promotions=total("mori_promotions_total"),
        demotions_to_cpu=total("mori_demotions_total", to="cpu"),
        demotions_to_none=total("mori_demotions_total", to="none"),
        held_requests=total("mori_held_requests_total"),
        demotions_to_disk=total("mori_demotions_total", to="disk") or None,
    )
