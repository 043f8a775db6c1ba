"""vLLM (0.32) as a MORI engine: priorities, capacity and prefix-cache counters from
``/metrics``, exact prompt sizes from ``/tokenize``, per-program residency from KV events,
warm-up prefetch (``mori.engines.kv_events_adapter``).

What the engine must run with (``mori vllm-args`` prints it, with the MORI plug-in's
flags; ``scripts/start_vllm_cpu.sh`` uses it)::

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
- ``session_id`` (default ``auto``): each request of a program carries ``session_id`` = the
  program id in its body, and in the ``X-Session-ID`` header when the id is printable
  ASCII, whatever the attribution, so that the engine (its KV events, the MORI plug-in,
  another cache policy) knows each request's program with or without the plug-in. vLLM
  0.32 to 0.34 read both (``entrypoints/generate/base/serving.py``: the body first). ``auto``
  sends them unless the plug-in's handshake lists ``request_fields`` without
  ``session_id``; ``false`` sends the body's field only under ``session`` attribution
  (which needs it) and the header never.
- ``kv_hints`` (default ``auto``): each request of a program carries vLLM's ``kv_hints``
  with MORI's action (``mori.plugin_channel.kv_hints``: the program and its label, ``busy``
  while it runs), which reaches a host-tier cache policy as ``ReqContext.kv_hints``.
  ``auto`` sends it only when the plug-in's handshake lists ``kv_hints`` in
  ``request_fields`` (the fields vLLM's OpenAI request models declare): vLLM 0.32 to 0.34
  fill ``kv_hints`` through the Python API only, and their HTTP servers ignore the field, so
  ``auto`` sends none to them. ``true`` sends it anyway (an engine that reads it; a client's
  own ``kv_hints`` is left as it is). A label that changes while a program has no request
  in flight (``idle``, ``inactive``, a drop) reaches the engine only over the label
  channel (``labels``).
- ``priority`` (default true): send MORI's rank as vLLM's ``priority`` (lower first; MORI
  0 = most important, so the rank passes as it is, plus ``priority_offset``). Set false
  for an engine without ``--scheduling-policy priority``.
- ``prefetch``: offer warm-up requests (``PREFETCH``); default: only when the engine
  reports a host tier (``num_cpu_blocks``) or ``cpu_tokens`` is given. vLLM has no call
  that loads one prefix from the host tier; a request whose prefix is there does (the
  offloading connector loads the blocks the prefix cache finds on the host, and
  recomputes what is in neither tier), so the warm-up runs one prefill (of the part not
  on the GPU) and one decode step.
- ``labels``: the label endpoint of the MORI plug-in in the engine
  (``tcp://127.0.0.1:5558``; ``mori.vllm_plugin``, ``mori vllm-args``). When the plug-in
  answers the handshake, the adapter declares ``LABELS`` and ``DROP``: ``set_label``,
  ``drop`` and ``release`` (the label ``inactive``) go over the channel, and the
  handshake's ``cpu_tier_tokens`` (when > 0 and ``cpu_tokens`` is not given) sizes the
  policy's CPU tier. That host tier is write-through (vLLM's offloading connector copies
  every block as it is computed), so it also mirrors what is on the GPU: the policy's CPU
  tier is what it holds beyond the GPU pool, ``cpu_tier_tokens - gpu_tokens`` (0 when
  the host tier is no larger than the GPU pool), the simulator's write-through model. The
  handshake's ``disk_tier_tokens`` (MORI's disk tier behind the host tier, also written
  through) sizes the policy's disk tier the same way: what it holds beyond the host tier.
  When it does not answer, the adapter works as without the option
  (the engine's eviction is plain LRU) and says so once. A check every
  ``labels_check_s`` (5) re-handshakes: a plug-in that stops answering (a request or a
  handshake gets no reply within ``labels_timeout_s``, 2) takes ``LABELS`` and ``DROP``
  away; one that answers again first gets the full label table (``replace``), then they
  come back. The first handshake of a new adapter does not clear the engine's labels (a
  restarted gateway leaves them be; labels recorded before it are sent with ``set``).
  A handshake from another plug-in instance (the engine restarted
  between two checks) is answered with ``replace`` too. ``label_secret_file``: the
  secret the engine signs the channel with (``mori vllm-args --label-secret-file``; else
  ``$MORI_LABEL_SECRET_FILE``); required for an endpoint off this machine. A plug-in that answers
  ``residency`` (its handshake lists the op) is where the adapter reads residency while it
  answers: the plug-in's own tables, which a restarted gateway finds full (the KV events
  tell only what happened since the adapter started); ``ended`` are the programs labelled
  ``inactive``. Otherwise residency comes from the KV events, as without the plug-in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from mori.engines.base import (
    Capability,
    KVCapacity,
    RequestHints,
    UpstreamError,
)
from mori.engines.http import metric_sum, parse_prometheus
from mori.engines.kv_events_adapter import KVEventsAdapter
from mori.engines.label_channel import LabelChannel
from mori.engines.plugin_link import PluginLink
from mori.plugin_channel import kv_hints as mori_kv_hints

log = logging.getLogger(__name__)

ATTRIBUTIONS = ("session", "salt", "tokens", "none")
SESSION_HEADER = "X-Session-ID"  # vLLM's (entrypoints/generate/base/serving.py)
RUNNING_LABEL = "busy"  # a program's label while a request of it runs


def header_safe(value: str) -> bool:
    """Whether ``value`` goes in an HTTP header as it is (printable ASCII, not empty)."""
    return bool(value) and all(" " <= c <= "~" for c in value)


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


def beyond_mirror(host_tokens: int, gpu_tokens: int) -> int:
    """The CPU tier a write-through host tier of ``host_tokens`` gives the policy: what it
    holds beyond a mirror of the GPU pool's ``gpu_tokens``."""
    return max(0, host_tokens - gpu_tokens)


class VLLMAdapter(KVEventsAdapter):
    """A vLLM OpenAI-compatible server (see the module docstring for its options)."""

    kind = "vllm"
    load_gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    engine_name = "vLLM"
    tokenize_path = "/tokenize"
    no_prefetch = "has no host tier to prefetch from"

    def __init__(self, url: str, *, timeout_s: float = 600.0, kv_tokens: int = 0,
                 cpu_tokens: int = 0, page_tokens: int = 0, connect_timeout_s: float = 5.0,
                 kv_events: str | None = None, kv_events_topic: str = "kv-events",
                 attribution: str = "session", priority: bool = True,
                 priority_offset: int = 0, prefetch: bool | None = None,
                 labels: str | None = None, labels_timeout_s: float = 2.0,
                 labels_check_s: float = 5.0, label_secret_file: str | None = None,
                 session_id: bool | None = None, kv_hints: bool | None = None) -> None:
        if labels_check_s <= 0:
            raise ValueError(f"labels_check_s must be > 0, got {labels_check_s}")
        if attribution not in ATTRIBUTIONS:
            raise ValueError(f"unknown attribution {attribution!r}; valid: "
                             f"{', '.join(ATTRIBUTIONS)}")
        super().__init__(url, timeout_s=timeout_s, kv_tokens=kv_tokens, cpu_tokens=cpu_tokens,
                         page_tokens=page_tokens, connect_timeout_s=connect_timeout_s,
                         kv_events=kv_events, kv_events_topic=kv_events_topic,
                         attribution=attribution, prefetch=prefetch)
        self.priority = priority
        self.priority_offset = priority_offset
        self.session_id_opt = session_id
        self.kv_hints_opt = kv_hints
        self._hint_ids = itertools.count(1)
        self._hint_prefix = hashlib.sha256(f"{url} {id(self)}".encode()).hexdigest()[:12]
        caps = {Capability.TOKENIZE}
        if priority:
            caps.add(Capability.PRIORITY)
        if prefetch or (prefetch is None and cpu_tokens > 0):
            caps.add(Capability.PREFETCH)
        self.capabilities = self.capabilities | caps
        self._plugin_cpu_tokens = 0
        self._plugin_disk_tokens = 0
        self.link = PluginLink(labels, timeout_s=labels_timeout_s, check_s=labels_check_s,
                               name=f"vLLM {url}", fallback="plain LRU",
                               on_up=self._plugin_up, on_down=self._plugin_down,
                               logger=log, secret_file=label_secret_file) if labels else None

    # -- the plug-in's label channel ----------------------------------------------------------
    @property
    def label_channel(self) -> LabelChannel | None:
        return None if self.link is None else self.link.channel

    @property
    def plugin(self) -> dict[str, Any] | None:
        """The plug-in's last handshake (None: it has not answered yet)."""
        return None if self.link is None else self.link.hello

    @property
    def plugin_connections(self) -> int:
        """Handshakes that (re)established the channel."""
        return 0 if self.link is None else self.link.connections

    def _plugin_up(self, hello: dict[str, Any]) -> None:
        self._take_cpu_tier(hello)
        super()._plugin_up(hello)

    def _take_cpu_tier(self, hello: dict[str, Any]) -> None:
        tokens = hello.get("cpu_tier_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            return
        self._plugin_cpu_tokens = tokens
        cap = self._capacity
        if self.cpu_tokens <= 0 and cap is not None:
            cpu = beyond_mirror(tokens, cap.gpu_tokens)
            if cap.cpu_tokens != cpu:
                self._capacity = dataclasses.replace(cap, cpu_tokens=cpu)
            if cpu > 0 and self.prefetch_opt is None:
                self.capabilities = self.capabilities | {Capability.PREFETCH}
        self._take_disk_tier(hello)

    def _take_disk_tier(self, hello: dict[str, Any]) -> None:
        """The plug-in's disk tier (``disk_tier_tokens``), written through from the host
        tier: the policy's disk tier is what it holds beyond the host tier."""
        tokens = hello.get("disk_tier_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
            return
        self._plugin_disk_tokens = disk = beyond_mirror(tokens, self._plugin_cpu_tokens)
        cap = self._capacity
        if cap is not None and cap.disk_tokens != disk:
            self._capacity = dataclasses.replace(cap, disk_tokens=disk)

    # -- request shaping ----------------------------------------------------------------
    def accepts(self, field: str) -> bool:
        """Whether requests get ``field`` (``session_id`` or ``kv_hints``): the option when
        given, else what the plug-in's handshake says the engine's request models declare
        (``request_fields``), else vLLM 0.32 to 0.34's answer (``session_id`` yes,
        ``kv_hints`` no)."""
        opt = self.session_id_opt if field == "session_id" else self.kv_hints_opt
        if opt is not None:
            return opt
        hello = self.plugin
        declared = None if hello is None else hello.get("request_fields")
        if isinstance(declared, list):
            return field in declared
        return field == "session_id"

    def request_headers(self, hints: RequestHints) -> dict[str, str]:
        pid = hints.program_id
        if pid and header_safe(pid) and self.accepts("session_id"):
            return {SESSION_HEADER: pid}
        return {}

    def shape_body(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        out = dict(body)
        if self.priority:
            out["priority"] = int(hints.priority) + self.priority_offset
        pid = hints.program_id
        if pid and (self.attribution == "session" or self.accepts("session_id")):
            out["session_id"] = pid
        if pid and out.get("kv_hints") is None and self.accepts("kv_hints"):
            out["kv_hints"] = mori_kv_hints.envelope(
                pid, RUNNING_LABEL, f"mori-{self._hint_prefix}-{next(self._hint_ids)}")
        if pid and self.attribution == "session":
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
        cpu_known = self.cpu_tokens > 0 or self._plugin_cpu_tokens > 0
        if self.kv_tokens <= 0 or self.page_tokens <= 0 or not cpu_known:
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
            gpu = (blocks - 1) * block  # vLLM keeps one block aside (its null block)
        if self.cpu_tokens > 0:
            cpu = self.cpu_tokens
        elif self._plugin_cpu_tokens > 0:
            cpu = beyond_mirror(self._plugin_cpu_tokens, gpu)
        else:
            cpu = (_label_int(labels, "num_cpu_blocks") or 0) * block
        self._capacity = KVCapacity(gpu_tokens=gpu, cpu_tokens=cpu, page_tokens=block,
                                    disk_tokens=self._plugin_disk_tokens)
        if cpu > 0 and self.prefetch_opt is None:
            self.capabilities = self.capabilities | {Capability.PREFETCH}
        return self._capacity

    async def prefix_cache(self) -> PrefixCacheCounters:
        """``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``."""
        samples = parse_prometheus(await self.get_text("/metrics"))
        return PrefixCacheCounters(
            queries=metric_sum(samples, "vllm:prefix_cache_queries_total"),
            hits=metric_sum(samples, "vllm:prefix_cache_hits_total"))
