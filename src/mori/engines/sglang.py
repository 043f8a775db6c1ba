"""SGLang (0.5.x) as a MORI engine: capacity from ``/get_server_info``, priorities in
SGLang's convention, KV events, warm-up prefetch with HiCache
(``mori.engines.kv_events_adapter``).

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

Prefetch: with HiCache, SGLang loads a prefix it finds in the host pool back to the
device when a request matches it; the warm-up request makes that happen before the real
request is let through.

The MORI plug-in (``mori.sglang_plugin``, ``--radix-cache-backend mori``; ``mori
sglang-args`` prints the flags): every forwarded request names its program in the
``x-smg-routing-key`` header (percent-encoded; SGLang keeps it as the request's
``routing_key``, and the plug-in tags the radix-tree nodes the request inserts or matches
with it). With the option ``labels`` (the plug-in's label endpoint,
``tcp://127.0.0.1:5558``) the adapter speaks the label channel exactly as the vLLM
adapter does (``mori.engines.plugin_link``): when the plug-in answers the handshake it
declares ``LABELS`` and ``DROP`` (labels, drops and ``release``, the label ``inactive``,
go over the channel); a plug-in that stops answering takes them away, and eviction is
SGLang's own order until it answers again and gets the full table (``labels_timeout_s``
2, ``labels_check_s`` 5).
"""

from __future__ import annotations

import logging
from typing import Any

from mori.engines.base import (
    Capability,
    KVCapacity,
    RequestHints,
    UpstreamError,
)
from mori.engines.kv_events_adapter import KVEventsAdapter
from mori.engines.plugin_link import PluginLink
from mori.sglang_plugin.order import ROUTING_HEADER, routing_key

log = logging.getLogger(__name__)



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


class SGLangAdapter(KVEventsAdapter):
    """An SGLang server (see the module docstring).

    Options: ``kv_tokens`` / ``cpu_tokens`` override the capacity the server reports;
    ``kv_bytes_per_token`` converts ``--hicache-size`` GB to tokens; ``priority`` (None:
    from the server's ``enable_priority_scheduling``), ``priority_low_first`` (None: from
    ``schedule_low_priority_values_first``), ``priority_base``; ``kv_events``,
    ``kv_events_topic``, ``attribution`` (``tokens`` or ``none``); ``prefetch`` (None:
    when the server runs HiCache); ``labels`` (the MORI plug-in's label endpoint),
    ``labels_timeout_s``, ``labels_check_s``, ``label_secret_file`` (the label channel's
    secret, as the engine's ``$MORI_LABEL_SECRET_FILE``).
    """

    kind = "sglang"
    load_gauges = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
    engine_name = "SGLang"
    tokenize_path = "/v1/tokenize"
    no_prefetch = "runs without HiCache: nothing to prefetch"

    def __init__(self, url: str, *, timeout_s: float = 600.0, kv_tokens: int = 0,
                 cpu_tokens: int = 0, page_tokens: int = 0, connect_timeout_s: float = 5.0,
                 kv_bytes_per_token: int = 0, priority: bool | None = None,
                 priority_low_first: bool | None = None, priority_base: int = 0,
                 kv_events: str | None = None, kv_events_topic: str = "kv-events",
                 attribution: str = "tokens", prefetch: bool | None = None,
                 labels: str | None = None, labels_timeout_s: float = 2.0,
                 labels_check_s: float = 5.0, label_secret_file: str | None = None) -> None:
        if attribution not in ("tokens", "none"):
            raise ValueError(f"unknown attribution {attribution!r} for SGLang; valid: tokens, "
                             "none (SGLang's KV events carry no session id or salt)")
        super().__init__(url, timeout_s=timeout_s, kv_tokens=kv_tokens, cpu_tokens=cpu_tokens,
                         page_tokens=page_tokens, connect_timeout_s=connect_timeout_s,
                         kv_events=kv_events, kv_events_topic=kv_events_topic,
                         attribution=attribution, prefetch=prefetch)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.priority = priority
        self.priority_low_first = priority_low_first
        self.priority_base = priority_base
        self.server_info: dict[str, Any] | None = None
        caps: set[Capability] = set()
        if priority is not False:
            caps.add(Capability.PRIORITY)
        if self.attribution == "tokens":
            caps.add(Capability.TOKENIZE)
        if prefetch:
            caps.add(Capability.PREFETCH)
        self.capabilities = self.capabilities | caps
        self.link = PluginLink(labels, timeout_s=labels_timeout_s, check_s=labels_check_s,
                               name=f"SGLang {url}", fallback="SGLang's own order",
                               on_up=self._plugin_up, on_down=self._plugin_down,
                               logger=log, secret_file=label_secret_file) if labels else None

    # -- the MORI plug-in ---------------------------------------------------------------
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
        self.capabilities = frozenset(caps)

    # -- request shaping ----------------------------------------------------------------
    def sglang_priority(self, rank: int) -> int:
        """MORI's rank (0 = most important) in SGLang's convention."""
        return self.priority_base + rank if self.priority_low_first else self.priority_base - rank

    def request_headers(self, hints: RequestHints) -> dict[str, str]:
        """The program's name for the MORI plug-in (SGLang's ``routing_key``)."""
        return {ROUTING_HEADER: routing_key(hints.program_id)} if hints.program_id else {}

    def shape_body(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        if Capability.PRIORITY not in self.capabilities:
            return body
        out = dict(body)
        out["priority"] = self.sglang_priority(int(hints.priority))
        return out

    # -- capacity -------------------------------------------------------------------------
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
