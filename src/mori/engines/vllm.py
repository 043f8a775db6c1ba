"""vLLM (0.32) as a MORI engine: priorities, capacity and prefix-cache counters from
``/metrics``, exact prompt sizes from ``/tokenize``, per-program residency from KV events,
warm-up prefetch (``mori.engines.engine_common``).

What the engine must run with (``scripts/start_vllm_cpu.sh`` does all of it)::

    --scheduling-policy priority          # else any priority but 0 is refused (400)
    --enable-prefix-caching
    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "topic": "kv-events"}'
    --enable-prompt-tokens-details        # cached_tokens in usage

Options (``--backend vllm=URL,key=value,...``; ``mori.engines.registry.parse_backend``):

- ``kv_tokens``: GPU KV capacity in tokens; 0 (default) reads it from the engine's
  ``vllm:cache_config_info`` (``num_gpu_blocks`` x ``block_size``).
- ``cpu_tokens``: host-tier capacity in tokens; 0 reads ``num_cpu_blocks`` x
  ``block_size`` where the engine reports it (``None`` on engines without offload).
- ``kv_events``: the ZMQ endpoint the engine publishes on (``tcp://127.0.0.1:5557``);
  without it the adapter reports no residency. ``kv_events_topic`` (``kv-events``).
- ``attribution``: how KV blocks are tied to programs (``mori.engines.kvevents``):
  ``session`` (default): each request carries ``session_id`` = the program id and
  ``vllm_xargs.kv_cache_report_mode = "full"``, so vLLM tags the blocks it stores *and*
  re-reports the cached blocks a request reuses; prefixes stay shared across programs.
  ``salt``: each request carries ``cache_salt`` derived from the program id; blocks are
  told apart by the salt, and no prefix is shared across programs (each program
  recomputes a common system prompt once). ``tokens``: before each request the adapter
  asks ``/tokenize`` for the prompt's token ids and matches them against the token ids in
  ``BlockStored`` (one extra round trip and tokenization per request; prefixes stay
  shared). ``none``: no attribution.
- ``priority`` (default true): send MORI's rank as vLLM's ``priority`` (lower first; MORI
  0 = most important, so the rank passes as it is, plus ``priority_offset``). Set false
  for an engine without ``--scheduling-policy priority``.
- ``prefetch``: offer warm-up requests (``PREFETCH``); default: only when the engine
  reports a host tier (``num_cpu_blocks``) or ``cpu_tokens`` is given. vLLM has no call
  that loads one prefix from the host tier; a request whose prefix is there does (the
  offloading connector loads the blocks the prefix cache finds on the host, and
  recomputes what is in neither tier), so the warm-up runs one prefill (of the part not
  on the GPU) and one decode step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from mori.engines.base import Capability, KVCapacity, RequestHints, UpstreamError
from mori.engines.engine_common import KVEventsAdapter
from mori.engines.http import metric_sum, parse_prometheus

ATTRIBUTIONS = ("session", "salt", "tokens", "none")


@dataclass(frozen=True, slots=True)
class PrefixCacheCounters:
    """The engine's prefix-cache counters (tokens), cumulative since it started."""

    queries: float
    hits: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries > 0 else 0.0


def _label_int(labels: dict[str, str], name: str) -> int | None:
    v = labels.get(name)
    if v is None:
        return None
    try:
        return int(float(v))
    except ValueError:  # "None"
        return None


def cache_config(metrics_text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (empty if the engine does not export it)."""
    rows = parse_prometheus(metrics_text).get("vllm:cache_config_info") or []
    return dict(rows[0][0]) if rows else {}


def program_salt(program_id: str) -> str:
    """The ``cache_salt`` for a program: stable, opaque, distinct per program."""
    return "mori-" + hashlib.sha256(program_id.encode()).hexdigest()[:24]


class VLLMAdapter(KVEventsAdapter):
    """A vLLM OpenAI-compatible server (see the module docstring for its options)."""

    kind = "vllm"
    engine_name = "vLLM"
    tokenize_path = "/tokenize"
    no_prefetch = "has no host tier to prefetch from"

    def __init__(self, url: str, *, timeout_s: float = 600.0, kv_tokens: int = 0,
                 cpu_tokens: int = 0, page_tokens: int = 0, connect_timeout_s: float = 5.0,
                 kv_events: str | None = None, kv_events_topic: str = "kv-events",
                 attribution: str = "session", priority: bool = True,
                 priority_offset: int = 0, prefetch: bool | None = None) -> None:
        if attribution not in ATTRIBUTIONS:
            raise ValueError(f"unknown attribution {attribution!r}; valid: "
                             f"{', '.join(ATTRIBUTIONS)}")
        super().__init__(url, timeout_s=timeout_s, kv_tokens=kv_tokens, cpu_tokens=cpu_tokens,
                         page_tokens=page_tokens, connect_timeout_s=connect_timeout_s,
                         kv_events=kv_events, kv_events_topic=kv_events_topic,
                         attribution=attribution, prefetch=prefetch)
        self.priority = priority
        self.priority_offset = priority_offset
        caps = {Capability.TOKENIZE}
        if priority:
            caps.add(Capability.PRIORITY)
        if prefetch or (prefetch is None and cpu_tokens > 0):
            caps.add(Capability.PREFETCH)
        self.capabilities = self.capabilities | caps

    # -- request shaping ----------------------------------------------------------------
    def shape_body(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        out = dict(body)
        if self.priority:
            out["priority"] = int(hints.priority) + self.priority_offset
        pid = hints.program_id
        if pid and self.attribution == "session":
            out["session_id"] = pid
            xargs = dict(out.get("vllm_xargs") or {})
            xargs["kv_cache_report_mode"] = "full"
            out["vllm_xargs"] = xargs
        elif pid and self.attribution == "salt":
            salt = out.get("cache_salt") or program_salt(pid)
            out["cache_salt"] = salt
            if self.index is not None:
                self.index.register_salt(salt, pid)
        return out

    # -- capacity and counters --------------------------------------------------------------
    async def capacity(self) -> KVCapacity:
        if self._capacity is not None:
            return self._capacity
        labels: dict[str, str] = {}
        if self.kv_tokens <= 0 or self.page_tokens <= 0 or self.cpu_tokens <= 0:
            try:
                labels = cache_config(await self.get_text("/metrics"))
            except UpstreamError:
                if self.kv_tokens <= 0:
                    raise
        block = self.page_tokens or _label_int(labels, "block_size") or 16
        gpu = self.kv_tokens
        if gpu <= 0:
            blocks = _label_int(labels, "num_gpu_blocks")
            if blocks is None:
                raise UpstreamError(
                    f"vLLM {self.url} exports no vllm:cache_config_info num_gpu_blocks; give "
                    "the capacity as kv_tokens (--backend vllm=URL,kv_tokens=N)",
                    unhealthy=False)
            gpu = blocks * block
        cpu = self.cpu_tokens
        if cpu <= 0:
            cpu = (_label_int(labels, "num_cpu_blocks") or 0) * block
        self._capacity = KVCapacity(gpu_tokens=gpu, cpu_tokens=cpu, page_tokens=block)
        if cpu > 0 and self.prefetch_opt is None:
            self.capabilities = self.capabilities | {Capability.PREFETCH}
        return self._capacity

    async def prefix_cache(self) -> PrefixCacheCounters:
        """``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``."""
        samples = parse_prometheus(await self.get_text("/metrics"))
        return PrefixCacheCounters(
            queries=metric_sum(samples, "vllm:prefix_cache_queries_total"),
            hits=metric_sum(samples, "vllm:prefix_cache_hits_total"))
