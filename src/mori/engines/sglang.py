"""SGLang (0.5.x) as a MORI engine: capacity from ``/get_server_info``, load from
``/v1/loads``, ``/get_load`` or ``/metrics``, priorities in SGLang's convention, KV events,
warm-up prefetch with HiCache.

A deployment for MORI starts SGLang with (``hicache_flags()`` returns them)::

    --enable-priority-scheduling          # request field ``priority`` honoured
    --radix-eviction-policy priority      # a node keeps the highest priority that touched it
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-write-policy write_through
    --enable-metrics
    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "topic": "kv-events"}'

Priority: SGLang runs higher values first unless the server has
``--schedule-low-priority-values-first``; the adapter reads both settings from
``/get_server_info`` at start (``priority`` and ``priority_low_first`` override) and sends
``priority_base - rank`` (high first) or ``priority_base + rank`` (low first), MORI's rank 0
being its most important program.

Capacity: ``max_total_num_tokens`` (the device pool, in tokens) and ``page_size``. With
HiCache the host pool is ``hicache_ratio`` x the device pool, or ``hicache_size`` GB
(converted with ``kv_bytes_per_token``); under write-through it mirrors what is on the
device, so MORI's CPU tier (KV *not* on the GPU) is the host pool less the device pool.

KV events: SGLang publishes the vLLM layout (array form; ``medium`` ``GPU``,
``CPU_PINNED``, ``DISK``) without session ids or salts, so programs are attributed by
token ids (``attribution=tokens``: a ``/v1/tokenize`` call per request, assumed to take
vLLM's schema; not checked against a running SGLang) or not at all.
"""

from __future__ import annotations

import logging
from typing import Any

from mori.engines.base import (
    Capability,
    EngineLoad,
    KVCapacity,
    NotSupportedError,
    RequestHints,
    Residency,
    UpstreamError,
    UpstreamResponse,
)
from mori.engines.http import OpenAIHTTPAdapter, parse_prometheus
from mori.engines.kvevents import KVBlockIndex, KVEventSubscriber
from mori.engines.vllm import tokenize_payload, warmup_body

log = logging.getLogger(__name__)

LOAD_SOURCES = ("auto", "loads", "get_load", "metrics")


def hicache_flags(events_port: int = 5557, ratio: float = 2.0) -> list[str]:
    """The SGLang server flags a MORI deployment needs (see the module docstring)."""
    return [
        "--enable-priority-scheduling",
        "--radix-eviction-policy", "priority",
        "--enable-hierarchical-cache", "--hicache-ratio", f"{ratio:g}",
        "--hicache-write-policy", "write_through",
        "--enable-metrics",
        "--kv-events-config",
        '{"enable_kv_cache_events": true, "publisher": "zmq", '
        f'"endpoint": "tcp://*:{events_port}", "topic": "kv-events"}}',
    ]


def _num(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _metric(samples: dict[str, list[tuple[dict[str, str], float]]], name: str
            ) -> list[float]:
    rows = samples.get("sglang:" + name) or samples.get("sglang_" + name) or []
    return [v for _, v in rows]


class SGLangAdapter(OpenAIHTTPAdapter):
    """An SGLang server (see the module docstring).

    Options: ``kv_tokens`` / ``cpu_tokens`` override the capacity the server reports;
    ``kv_bytes_per_token`` converts ``--hicache-size`` GB to tokens; ``priority`` (None:
    from the server's ``enable_priority_scheduling``), ``priority_low_first`` (None: from
    ``schedule_low_priority_values_first``), ``priority_base``; ``load_source`` (``auto``
    tries ``/v1/loads``, then ``/get_load``, then ``/metrics``); ``kv_events``,
    ``kv_events_topic``, ``attribution`` (``tokens`` or ``none``); ``prefetch`` (None:
    when the server runs HiCache).
    """

    kind = "sglang"
    capabilities = frozenset({Capability.PRIORITY})

    def __init__(self, url: str, *, timeout_s: float = 600.0, kv_tokens: int = 0,
                 cpu_tokens: int = 0, page_tokens: int = 0, connect_timeout_s: float = 5.0,
                 kv_bytes_per_token: int = 0, priority: bool | None = None,
                 priority_low_first: bool | None = None, priority_base: int = 0,
                 load_source: str = "auto", kv_events: str | None = None,
                 kv_events_topic: str = "kv-events", attribution: str = "tokens",
                 prefetch: bool | None = None) -> None:
        super().__init__(url, timeout_s=timeout_s, kv_tokens=kv_tokens,
                         page_tokens=page_tokens, connect_timeout_s=connect_timeout_s)
        if load_source not in LOAD_SOURCES:
            raise ValueError(f"unknown load_source {load_source!r}; valid: "
                             f"{', '.join(LOAD_SOURCES)}")
        if attribution not in ("tokens", "none"):
            raise ValueError(f"unknown attribution {attribution!r} for SGLang; valid: tokens, "
                             "none (SGLang's KV events carry no session id or salt)")
        self.cpu_tokens = cpu_tokens
        self.kv_bytes_per_token = kv_bytes_per_token
        self.priority = priority
        self.priority_low_first = priority_low_first
        self.priority_base = priority_base
        self.load_source = load_source
        self.kv_events = kv_events or None
        self.attribution = attribution if self.kv_events else "none"
        self.prefetch_opt = prefetch
        self.server_info: dict[str, Any] | None = None
        self._capacity: KVCapacity | None = None
        self._load_path: str | None = None if load_source == "auto" else load_source
        self.index: KVBlockIndex | None = None
        self._subscriber: KVEventSubscriber | None = None
        caps = set(type(self).capabilities)
        if priority is False:
            caps.discard(Capability.PRIORITY)
        if self.kv_events:
            rules = ("tokens",) if self.attribution == "tokens" else ()
            self.index = KVBlockIndex(rules)
            self._subscriber = KVEventSubscriber(self.kv_events, self.index, kv_events_topic)
            if self.attribution == "tokens":
                caps |= {Capability.RESIDENCY, Capability.TOKENIZE}
        if prefetch:
            caps.add(Capability.PREFETCH)
        self.capabilities = frozenset(caps)  # type: ignore[misc]  # per instance

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        if self._subscriber is not None:
            await self._subscriber.start()
        try:
            await self.capacity()
        except UpstreamError as e:
            log.info("SGLang %s: server info not available yet (%s)", self.url, e.message)

    async def close(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()
        await super().close()

    async def fetch_server_info(self) -> dict[str, Any]:
        """``/get_server_info`` (``/server_info`` on servers that renamed it)."""
        last: UpstreamError | None = None
        for path in ("/get_server_info", "/server_info"):
            try:
                data = await self.get_json(path)
            except UpstreamError as e:
                last = e
                continue
            if isinstance(data, dict):
                self.server_info = data
                self._apply_server_settings(data)
                return data
        raise last or UpstreamError(f"SGLang {self.url}: no server info")

    def _apply_server_settings(self, info: dict[str, Any]) -> None:
        caps = set(self.capabilities)
        if self.priority is None:
            enabled = bool(info.get("enable_priority_scheduling", False))
            if enabled:
                caps.add(Capability.PRIORITY)
            else:
                caps.discard(Capability.PRIORITY)
        if self.priority_low_first is None:
            self.priority_low_first = bool(info.get("schedule_low_priority_values_first",
                                                    False))
        if self.prefetch_opt is None and info.get("enable_hierarchical_cache"):
            caps.add(Capability.PREFETCH)
        self.capabilities = frozenset(caps)  # type: ignore[misc]

    # -- request shaping ----------------------------------------------------------------
    def sglang_priority(self, rank: int) -> int:
        """MORI's rank (0 = most important) in SGLang's convention."""
        return self.priority_base + rank if self.priority_low_first else self.priority_base - rank

    def shape_body(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        if Capability.PRIORITY not in self.capabilities:
            return body
        out = dict(body)
        out["priority"] = self.sglang_priority(int(hints.priority))
        return out

    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        if self.attribution == "tokens" and self.index is not None and hints.program_id:
            ids = await self._tokenize(body)
            if ids is not None:
                self.index.learn_tokens(hints.program_id, ids)
        return await super().forward(path, body, stream, hints)

    async def _tokenize(self, body: dict[str, Any]) -> list[int] | None:
        payload = tokenize_payload(body)
        if payload is None:
            return None
        try:
            data = await self.post_json("/v1/tokenize", payload, timeout_s=30.0)
        except UpstreamError as e:
            log.debug("SGLang %s /v1/tokenize failed: %s", self.url, e.message)
            return None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    async def count_prompt_tokens(self, path: str, body: dict[str, Any]) -> int | None:
        if Capability.TOKENIZE not in self.capabilities:
            return None
        ids = await self._tokenize(body)
        return len(ids) if ids is not None else None

    # -- capacity and load ----------------------------------------------------------------
    async def capacity(self) -> KVCapacity:
        if self._capacity is not None:
            return self._capacity
        info = await self.fetch_server_info()
        gpu = self.kv_tokens
        if gpu <= 0:
            v = _num(info, "max_total_num_tokens")
            if v is None:
                states = info.get("internal_states")
                if isinstance(states, list) and states and isinstance(states[0], dict):
                    v = _num(states[0], "max_total_num_tokens")
            if v is None:
                raise UpstreamError(
                    f"SGLang {self.url}/get_server_info has no max_total_num_tokens; give "
                    "the capacity as kv_tokens", unhealthy=False)
            gpu = int(v)
        page = self.page_tokens or int(_num(info, "page_size") or 1)
        cpu = self.cpu_tokens if self.cpu_tokens > 0 else self._host_tokens(info, gpu)
        self._capacity = KVCapacity(gpu_tokens=gpu, cpu_tokens=cpu, page_tokens=page,
                                    kv_bytes_per_token=self.kv_bytes_per_token or 1)
        return self._capacity

    def _host_tokens(self, info: dict[str, Any], gpu: int) -> int:
        if not info.get("enable_hierarchical_cache"):
            return 0
        size_gb = _num(info, "hicache_size") or 0.0
        if size_gb > 0:
            if self.kv_bytes_per_token <= 0:
                log.warning("SGLang %s: --hicache-size %s GB but no kv_bytes_per_token to "
                            "convert it; host tier not counted (give cpu_tokens)",
                            self.url, size_gb)
                return 0
            host = int(size_gb * 1e9 // self.kv_bytes_per_token)
        else:
            host = int((_num(info, "hicache_ratio") or 2.0) * gpu)
        return max(0, host - gpu)

    async def load(self) -> EngineLoad:
        order = [self._load_path] if self._load_path else ["loads", "get_load", "metrics"]
        last: UpstreamError | None = None
        for source in order:
            try:
                load = await self._load_from(source)
            except (UpstreamError, ValueError, KeyError, TypeError) as e:
                last = e if isinstance(e, UpstreamError) else UpstreamError(
                    f"SGLang {self.url}: unexpected {source} answer: {e}", unhealthy=False)
                continue
            self._load_path = source
            return load
        raise last or UpstreamError(f"SGLang {self.url}: no load source answered")

    async def _load_from(self, source: str) -> EngineLoad:
        if source == "metrics":
            samples = parse_prometheus(await self.get_text("/metrics"))
            usages = _metric(samples, "token_usage")
            runs = _metric(samples, "num_running_reqs")
            if not runs and not usages:
                raise UpstreamError(f"SGLang {self.url}/metrics has no sglang: metrics "
                                    "(start it with --enable-metrics)", unhealthy=False)
            return EngineLoad(running=int(sum(runs)),
                              waiting=int(sum(_metric(samples, "num_queue_reqs"))),
                              kv_usage=min(1.0, max(usages) if usages else 0.0))
        if source == "loads":
            data = await self.get_json("/v1/loads")
            rows = data.get("loads") if isinstance(data, dict) else data
            if not isinstance(rows, list):
                raise TypeError("/v1/loads: no list of loads")
            running = waiting = 0
            usage = 0.0
            for r in rows:
                running += int(_num(r, "num_running_reqs") or 0)
                waiting += int(_num(r, "num_waiting_reqs") or 0)
                u = _num(r, "token_usage")
                if u is None:
                    used, total = _num(r, "num_used_tokens"), _num(r, "max_total_num_tokens")
                    u = used / total if used is not None and total else 0.0
                usage = max(usage, u)
            return EngineLoad(running=running, waiting=waiting, kv_usage=min(1.0, usage))
        # /get_load: [{dp_rank, num_reqs (running + waiting), num_waiting_reqs,
        # num_tokens (tokens in use plus those of waiting prompts)}, ...]
        data = await self.get_json("/get_load")
        rows = data if isinstance(data, list) else [data]
        running = waiting = tokens = 0
        for r in rows:
            if not isinstance(r, dict):
                raise TypeError("/get_load: entries are not objects")
            reqs = int(_num(r, "num_reqs") or 0)
            w = int(_num(r, "num_waiting_reqs") or 0)
            running += max(0, reqs - w)
            waiting += w
            tokens += int(_num(r, "num_tokens") or 0)
        cap = self._capacity.gpu_tokens if self._capacity else 0
        usage = min(1.0, tokens / (cap * len(rows))) if cap and rows else 0.0
        return EngineLoad(running=running, waiting=waiting, kv_usage=usage)

    # -- KV controls ---------------------------------------------------------------------
    async def residency(self) -> Residency:
        if self.index is None or self.attribution == "none":
            raise NotSupportedError(
                f"SGLang {self.url}: no residency without kv_events and attribution=tokens")
        return self.index.residency()

    async def release(self, program_id: str) -> None:
        if self.index is not None:
            self.index.forget_program(program_id)

    async def prefetch(self, program_id: str, path: str, body: dict[str, Any]) -> None:
        """Warm-up: the program's request with ``max_tokens=1``. With HiCache, SGLang loads
        a prefix it finds in the host pool back to the device when a request matches it;
        the warm-up makes that happen before the real request is let through (its output
        is discarded; it runs at the most important priority)."""
        if Capability.PREFETCH not in self.capabilities:
            raise NotSupportedError(f"SGLang {self.url} runs without HiCache: nothing to "
                                    "prefetch")
        resp = await self.forward(path, warmup_body(body), False,
                                  RequestHints(program_id=program_id))
        await resp.aclose()
        if resp.status >= 400:
            raise UpstreamError(f"SGLang {self.url} refused the warm-up request "
                                f"({resp.status})", status=resp.status, unhealthy=False)
