"""vLLM (0.32) as a MORI engine: priorities, capacity and load from ``/metrics``, exact
prompt sizes from ``/tokenize``, per-program residency from KV events, warm-up prefetch.

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
  reports a host tier (``num_cpu_blocks``) or ``cpu_tokens`` is given.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass
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
from mori.engines.http import OpenAIHTTPAdapter, metric_sum, parse_prometheus
from mori.engines.kvevents import KVBlockIndex, KVEventSubscriber

log = logging.getLogger(__name__)

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


def tokenize_payload(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` request for a chat or completion body (vLLM's schema: ``model`` with
    ``messages`` + ``add_generation_prompt``, or with ``prompt``), None for other bodies."""
    payload: dict[str, Any] = {}
    if "model" in body:
        payload["model"] = body["model"]
    if "messages" in body:
        payload["messages"] = body["messages"]
        payload["add_generation_prompt"] = body.get("add_generation_prompt", True)
        for k in ("tools", "chat_template", "chat_template_kwargs",
                  "continue_final_message", "add_special_tokens"):
            if k in body:
                payload[k] = body[k]
        return payload
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        payload["prompt"] = prompt
        return payload
    return None


def warmup_body(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of a request that asks for one output token, not streamed (a warm-up)."""
    warm = copy.deepcopy(body)
    warm["max_tokens"] = 1
    if "max_completion_tokens" in warm:
        warm["max_completion_tokens"] = 1
    warm["stream"] = False
    warm.pop("stream_options", None)
    warm["n"] = 1
    return warm


class VLLMAdapter(OpenAIHTTPAdapter):
    """A vLLM OpenAI-compatible server (see the module docstring for its options)."""

    kind = "vllm"
    capabilities = frozenset({Capability.PRIORITY, Capability.TOKENIZE})

    def __init__(self, url: str, *, timeout_s: float = 600.0, kv_tokens: int = 0,
                 cpu_tokens: int = 0, page_tokens: int = 0, connect_timeout_s: float = 5.0,
                 kv_events: str | None = None, kv_events_topic: str = "kv-events",
                 attribution: str = "session", priority: bool = True,
                 priority_offset: int = 0, prefetch: bool | None = None) -> None:
        super().__init__(url, timeout_s=timeout_s, kv_tokens=kv_tokens,
                         page_tokens=page_tokens, connect_timeout_s=connect_timeout_s)
        if attribution not in ATTRIBUTIONS:
            raise ValueError(f"unknown attribution {attribution!r}; valid: "
                             f"{', '.join(ATTRIBUTIONS)}")
        self.cpu_tokens = cpu_tokens
        self.kv_events = kv_events or None
        self.attribution = attribution if self.kv_events else "none"
        self.priority = priority
        self.priority_offset = priority_offset
        self.prefetch_opt = prefetch
        self.index: KVBlockIndex | None = None
        self._subscriber: KVEventSubscriber | None = None
        self._capacity: KVCapacity | None = None
        caps = set(type(self).capabilities)
        if not priority:
            caps.discard(Capability.PRIORITY)
        if self.kv_events:
            rules = () if self.attribution == "none" else (self.attribution,)
            self.index = KVBlockIndex(rules)
            self._subscriber = KVEventSubscriber(self.kv_events, self.index, kv_events_topic)
            if self.attribution != "none":
                caps.add(Capability.RESIDENCY)
        if prefetch or (prefetch is None and cpu_tokens > 0):
            caps.add(Capability.PREFETCH)
        self.capabilities = frozenset(caps)  # type: ignore[misc]  # per instance

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        if self._subscriber is not None:
            await self._subscriber.start()
        try:
            await self.capacity()
        except UpstreamError as e:  # the engine may still be starting: capacity() retries
            log.info("vLLM %s: capacity not known yet (%s)", self.url, e.message)

    async def close(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()
        await super().close()

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

    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        if self.attribution == "tokens" and self.index is not None and hints.program_id:
            ids = await self._tokenize(path, body)
            if ids is not None:
                self.index.learn_tokens(hints.program_id, ids)
        return await super().forward(path, body, stream, hints)

    # -- tokenization -------------------------------------------------------------------
    async def _tokenize(self, path: str, body: dict[str, Any]) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        payload = tokenize_payload(body)
        if payload is None:
            return None
        try:
            data = await self.post_json("/tokenize", payload, timeout_s=30.0)
        except UpstreamError as e:
            log.debug("vLLM %s /tokenize failed: %s", self.url, e.message)
            return None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    async def count_prompt_tokens(self, path: str, body: dict[str, Any]) -> int | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        payload = tokenize_payload(body)
        if payload is None:
            return None
        try:
            data = await self.post_json("/tokenize", payload, timeout_s=30.0)
        except UpstreamError:
            return None
        count = data.get("count") if isinstance(data, dict) else None
        return int(count) if isinstance(count, int | float) else None

    # -- capacity and load ----------------------------------------------------------------
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
            self.capabilities = self.capabilities | {Capability.PREFETCH}  # type: ignore[misc]
        return self._capacity

    async def load(self) -> EngineLoad:
        samples = parse_prometheus(await self.get_text("/metrics"))
        usage = metric_sum(samples, "vllm:kv_cache_usage_perc", -1.0)
        if usage < 0:  # engines before the rename
            usage = metric_sum(samples, "vllm:gpu_cache_usage_perc", 0.0)
        return EngineLoad(
            running=int(metric_sum(samples, "vllm:num_requests_running")),
            waiting=int(metric_sum(samples, "vllm:num_requests_waiting")),
            kv_usage=min(1.0, max(0.0, usage)))

    async def prefix_cache(self) -> PrefixCacheCounters:
        """``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``."""
        samples = parse_prometheus(await self.get_text("/metrics"))
        return PrefixCacheCounters(
            queries=metric_sum(samples, "vllm:prefix_cache_queries_total"),
            hits=metric_sum(samples, "vllm:prefix_cache_hits_total"))

    # -- KV controls ---------------------------------------------------------------------
    async def residency(self) -> Residency:
        if self.index is None or self.attribution == "none":
            raise NotSupportedError(
                f"vLLM {self.url}: no residency without kv_events and an attribution")
        return self.index.residency()

    async def release(self, program_id: str) -> None:
        if self.index is not None:
            self.index.forget_program(program_id)

    async def prefetch(self, program_id: str, path: str, body: dict[str, Any]) -> None:
        """Warm-up: send the program's request with ``max_tokens=1`` and no streaming.

        vLLM has no call that loads one prefix from the host tier; a request whose prefix
        is there does (the offloading connector loads the blocks the prefix cache finds on
        the host, and recomputes what is in neither tier). So the warm-up runs one prefill
        (of the part not on the GPU) and one decode step, and its output is discarded.
        It goes at priority 0 (the program is being promoted). Raises
        ``UpstreamError`` if the engine cannot be reached or refuses the request.
        """
        if Capability.PREFETCH not in self.capabilities:
            raise NotSupportedError(f"vLLM {self.url} has no host tier to prefetch from")
        resp = await self.forward(path, warmup_body(body), False, RequestHints(program_id=program_id))
        await resp.aclose()
        if resp.status >= 400:
            raise UpstreamError(f"vLLM {self.url} refused the warm-up request ({resp.status}): "
                                f"{(resp.body or b'')[:200]!r}", status=resp.status,
                                unhealthy=False)
