"""The simulated engine's Prometheus metrics (``mori_engine_*``), read at scrape time."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mori.sim.realtime import RealtimeReplica


class EngineCollector(Collector):
    """Reads the engine's state at scrape time (one per app, no global registry)."""

    def __init__(self, engine: RealtimeReplica) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        eng = self.engine
        eng.sync()
        st, c = eng.replica.stats, eng.counters
        model = [eng.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(model, value)
            return m

        yield gauge("mori_engine_requests_running", "Requests admitted (prefill, decode, "
                    "KV reload).", eng.running)
        yield gauge("mori_engine_requests_waiting", "Requests waiting for admission.",
                    eng.waiting)
        yield gauge("mori_engine_kv_usage_ratio", "Fraction of the GPU KV pool in use.",
                    eng.kv_usage())
        yield gauge("mori_engine_cpu_kv_usage_ratio", "Fraction of the host (CPU) KV tier in use, "
                    "its copies of the GPU's computed KV included (0 without one).",
                    eng.cpu_kv_usage())
        cap = GaugeMetricFamily("mori_engine_kv_capacity_tokens", "KV pool size in tokens.",
                                labels=["model_name", "tier"])
        cap.add_metric([eng.model_name, "gpu"], eng.gpu_pages * eng.page)
        cap.add_metric([eng.model_name, "cpu"], eng.cpu_pages * eng.page)
        yield cap
        yield counter("mori_engine_prompt_tokens", "Prompt tokens of admitted requests.",
                      st.prompt_tokens)
        yield counter("mori_engine_prefix_hit_tokens", "Prompt tokens found in the KV cache "
                      "(GPU or CPU tier).", st.gpu_hit_tokens + st.cpu_hit_tokens)
        yield counter("mori_engine_cpu_hit_tokens", "Prompt tokens reloaded from the CPU "
                      "tier.", st.cpu_hit_tokens)
        yield counter("mori_engine_prefill_tokens", "Prompt tokens computed.",
                      st.prefill_tokens)
        yield counter("mori_engine_recomputed_tokens", "Reusable prompt tokens computed "
                      "again (their KV had been lost).", st.recomputed_tokens)
        yield counter("mori_engine_generation_tokens", "Output tokens generated.",
                      c.generation_tokens)
        yield counter("mori_engine_requests", "Requests submitted.", c.requests)
        yield counter("mori_engine_requests_finished", "Requests finished.", c.finished)
        yield counter("mori_engine_requests_aborted", "Requests aborted (client gone, shutdown).",
                      c.aborted)
        yield counter("mori_engine_evicted_gpu_tokens", "KV tokens evicted from the GPU.",
                      eng.pools.evicted_gpu_pages * eng.page)
        yield counter("mori_engine_busy_seconds", "Simulated seconds the engine computed.",
                      st.busy_s)
