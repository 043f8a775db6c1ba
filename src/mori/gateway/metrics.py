"""The gateway's Prometheus metrics (``mori_`` prefix), one registry per app.

Counters and histograms are updated as things happen; gauges that describe the current
state (programs per tier, held requests, per-replica load), the distributions of the
programs' idleness and context over the tiers (gauge histograms: ``_bucket`` series that
describe the programs now, not events counted since start) and the decision executor's
promotion and demotion counts are read when ``/metrics`` is scraped, so they cannot
drift from what ``/v1/programs`` shows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: upper bounds of the idleness histogram (idleness is a share, 0..1)
IDLENESS_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
#: upper bounds of the context histogram, in tokens
CONTEXT_BUCKETS = (1_024, 4_096, 16_384, 32_768, 65_536, 131_072, 262_144, 524_288,
                   1_048_576)


@dataclass(slots=True)
class Distribution:
    """Values counted into fixed buckets: ``counts[i]`` of them are at most
    ``bounds[i]`` and above ``bounds[i-1]``; ``counts[-1]`` are above every bound."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def add(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.total += v

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus' buckets: (le, programs at most le), the last one ``+Inf``."""
        out: list[tuple[str, float]] = []
        run = 0
        for le, n in zip([*map(_le, self.bounds), "+Inf"], self.counts, strict=True):
            run += n
            out.append((le, float(run)))
        return out


def _le(b: float) -> str:
    return repr(float(b))


def distributions(rows: Iterable[tuple[str, float, int]]
                  ) -> tuple[dict[str, Distribution], dict[str, Distribution]]:
    """The idleness and the context distributions by tier of ``rows`` (tier, idleness,
    context tokens), one per tier that has a program."""
    idleness: dict[str, Distribution] = {}
    ctx: dict[str, Distribution] = {}
    for tier, i, tokens in rows:
        if tier not in idleness:
            idleness[tier] = Distribution(IDLENESS_BUCKETS)
            ctx[tier] = Distribution(CONTEXT_BUCKETS)
        idleness[tier].add(i)
        ctx[tier].add(tokens)
    return idleness, ctx


@dataclass(frozen=True, slots=True)
class ReplicaRow:
    """One replica's gauges."""

    running_requests: int
    healthy: bool
    gpu_programs: int
    cpu_programs: int
    gpu_kv_used_ratio: float
    engine_running: int | None = None  # the engine's reported load (None: unreported)
    engine_waiting: int | None = None


@dataclass(frozen=True, slots=True)
class GatewayState:
    """The state read at scrape time: programs per (tier, status), held requests and how
    long the longest held has waited (wall seconds), the replicas, and the executor's
    promotions (by source tier) and demotions (by destination)."""

    programs: dict[tuple[str, str], int]
    held: int
    replicas: list[ReplicaRow]
    oldest_wait_s: float = 0.0
    promotions: dict[str, int] = field(default_factory=dict)
    demotions: dict[str, int] = field(default_factory=dict)
    idleness: dict[str, Distribution] = field(default_factory=dict)
    context: dict[str, Distribution] = field(default_factory=dict)


_REPLICA_GAUGES = (
    ("running_requests", "Requests forwarded to the replica and not ended"),
    ("healthy", "1 if the replica answers, 0 if marked unhealthy"),
    ("gpu_programs", "Programs the policy placed on the replica's GPU tier"),
    ("cpu_programs", "Programs the policy placed on the replica's CPU tier"),
    ("gpu_kv_used_ratio", "Share of the replica's GPU KV the policy has placed"),
)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], GatewayState | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        s = self._read()
        if s is None:
            return
        g = GaugeMetricFamily("mori_programs", "Programs known to the policy, by tier and status",
                              labels=["tier", "status"])
        for (tier, status), n in sorted(s.programs.items()):
            g.add_metric([tier, status], n)
        yield g
        yield GaugeMetricFamily("mori_held_queue_length", "Requests held in the gateway now",
                                value=s.held)
        yield GaugeMetricFamily("mori_held_oldest_seconds", "How long the request held "
                                "longest has waited so far (0 when none is held): a program "
                                "kept waiting shows here before its request ends; "
                                "compare with --max-wait", value=s.oldest_wait_s)
        for name, doc in _REPLICA_GAUGES:
            fam = GaugeMetricFamily(f"mori_replica_{name}", doc, labels=["replica"])
            for i, row in enumerate(s.replicas):
                fam.add_metric([str(i)], float(getattr(row, name)))
            yield fam
        eng = GaugeMetricFamily("mori_replica_engine_requests", "Requests the replica's "
                                "engine reports, all clients' (where it reports them), by "
                                "state", labels=["replica", "state"])
        for i, row in enumerate(s.replicas):
            if row.engine_running is not None and row.engine_waiting is not None:
                eng.add_metric([str(i), "running"], row.engine_running)
                eng.add_metric([str(i), "waiting"], row.engine_waiting)
        yield eng
        promo = CounterMetricFamily("mori_promotions", "Programs moved to a GPU tier, by where "
                                    "their KV was", labels=["source"])
        for tier, n in sorted(s.promotions.items()):
            promo.add_metric([tier], n)
        yield promo
        demo = CounterMetricFamily("mori_demotions", "Programs moved off a GPU or CPU tier, by "
                                   "destination (cpu, disk where replicas have a disk tier, "
                                   "none)", labels=["to"])
        for tier, n in sorted(s.demotions.items()):
            demo.add_metric([tier], n)
        yield demo
        yield _gauge_histogram("mori_program_idleness_ratio", "Programs by idleness (the recent "
                               "share of time in tool calls), by tier",
                               s.idleness)
        yield _gauge_histogram("mori_program_context_tokens", "Programs by context length "
                               "(tokens of KV the policy accounts for), by tier", s.context)


def _gauge_histogram(name: str, doc: str, by_tier: dict[str, Distribution]) -> Metric:
    fam = GaugeHistogramMetricFamily(name, doc, labels=["tier"])
    for tier, d in sorted(by_tier.items()):
        fam.add_metric([tier], d.cumulative(), gsum_value=d.total)
    return fam


class Recorded:
    """A counter or histogram that also keeps, for the dashboard, the values it was given
    since the last ``take()`` (at most ``keep`` of them) and their running ``total``."""

    __slots__ = ("metric", "total", "_keep", "_values")

    def __init__(self, metric: Counter | Histogram, keep: int = 100_000) -> None:
        self.metric = metric
        self.total = 0.0
        self._keep = keep
        self._values: list[float] = []

    def _note(self, v: float) -> None:
        self.total += v
        if len(self._values) < self._keep:
            self._values.append(v)

    def observe(self, v: float) -> None:
        assert isinstance(self.metric, Histogram)
        self.metric.observe(v)
        self._note(v)

    def inc(self, v: float = 1.0) -> None:
        assert isinstance(self.metric, Counter)
        self.metric.inc(v)
        self._note(v)

    def take(self) -> list[float]:
        out, self._values = self._values, []
        return out


WORKER_TALLIES = ("disconnects", "stream_timeouts", "prompt_tokens", "completion_tokens",
                  "upstream_idle_timeouts", "sse_lines_too_long", "usage_clamped",
                  "responses_too_large")
"""The unlabelled counters of ``GatewayMetrics`` the completion path updates: a worker
process tallies them and sends the increments to the policy process
(``mori.gateway.worker_process.WorkerMetrics``), which adds them here."""


class GatewayMetrics:
    """All metrics of one gateway app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("mori_requests", "Client requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.held_total = Counter("mori_held_requests", "Requests that had to wait for "
                                  "GPU residency before being forwarded", registry=r)
        self.held_seconds = Histogram("mori_held_seconds", "Time a request was held in the "
                                      "gateway before being forwarded",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Recorded(Histogram(
            "mori_ttft_seconds", "Time from a request's arrival to its first streamed byte "
            "(streaming) or whole answer", buckets=_LATENCY_BUCKETS, registry=r))
        self.upstream_errors = Counter("mori_upstream_errors", "Engine failures by replica",
                                       ["replica"], registry=r)
        self.failovers = Counter("mori_failover_programs", "Programs moved off a replica "
                                 "marked unhealthy (their KV recomputed elsewhere)",
                                 registry=r)
        self.disconnects = Counter("mori_client_disconnects", "Streams the client left "
                                   "before the end", registry=r)
        self.stream_timeouts = Counter("mori_stream_timeouts", "Streams cut off because the "
                                       "client stopped reading (stream_write_timeout_s; also "
                                       "counted as client disconnects) or the engine sent "
                                       "nothing (stream_idle_timeout_s; also counted in "
                                       "mori_upstream_idle_timeouts)", registry=r)
        self.upstream_idle_timeouts = Counter(
            "mori_upstream_idle_timeouts", "Streams ended because their engine sent no byte "
            "for stream_idle_timeout_s (the replica probed at once)", registry=r)
        self.sse_lines_too_long = Counter(
            "mori_sse_lines_too_long", "Streams ended because their engine sent a line over "
            "max_sse_line_bytes (the engine's request aborted)", registry=r)
        self.responses_too_large = Counter(
            "mori_responses_too_large", "Whole (not streamed) answers cut off because their "
            "engine sent more than max_response_bytes (the engine's request aborted, the "
            "client answered 502)", registry=r)
        self.usage_clamped = Counter(
            "mori_usage_clamped", "Answers whose usage from the engine could not be true "
            "(a prompt over the context window, an output over max_tokens), booked clamped",
            registry=r)
        self.worker_requests = Counter("mori_worker_requests", "Completion requests served by "
                                       "each worker process (mori serve --workers)",
                                       ["worker"], registry=r)
        self.connections = Counter("mori_connections", "Client connections taken on the "
                                   "gateway's port by each process (mori serve --workers: "
                                   "the policy process keeps the first two open, the "
                                   "workers take the rest in turn)", ["process"], registry=r)
        self.prompt_tokens = Counter("mori_prompt_tokens", "Prompt tokens forwarded", registry=r)
        self.tool_time = Histogram("mori_tool_call_seconds", "Time an agent spent in tool "
                                   "calls, measured on the wire: from an answer that ended in "
                                   "a tool call to the request returning its results, by "
                                   "agent kind", ["agent"], buckets=_LATENCY_BUCKETS,
                                   registry=r)
        self.tool_time_error = Histogram(
            "mori_tool_call_prediction_error_seconds", "How far a tool call's predicted "
            "length (made when the answer ended in the call: mori.core.returns) was from "
            "its length measured on the wire, absolute, by agent kind", ["agent"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.completion_tokens = Recorded(Counter("mori_completion_tokens",
                                                  "Completion tokens returned", registry=r),
                                          keep=0)  # the dashboard reads only the total

    def watch(self, read: Callable[[], GatewayState | None]) -> None:
        """Expose the state gauges, read at scrape time from ``read()``."""
        self.registry.register(_StateCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)
