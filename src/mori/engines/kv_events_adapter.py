"""What the vLLM and SGLang adapters share: per-program residency from the engine's KV
events, prompt token ids from its tokenizer, and warm-up prefetch.

``KVEventsAdapter`` subscribes to the engine's KV events (``mori.engines.kvevents``) when
given an endpoint, and attributes blocks to programs (``mori.engines.kvindex``) by the
rule ``attribution`` names (``session``, ``salt``, ``tokens`` or ``none``). Under ``tokens`` it asks the engine to
tokenize each prompt before forwarding it. Prefetch is a warm-up request: the program's
request with ``max_tokens=1``, not streamed, at the most important priority; the engine
loads what it finds of the prefix in its host tier, and the output is discarded.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, ClassVar

from mori.core.types import KVLabel
from mori.engines.base import (
    Capability,
    KVCapacity,
    NotSupportedError,
    RequestHints,
    Residency,
    UpstreamError,
    UpstreamResponse,
)
from mori.engines.http import OpenAIHTTPAdapter
from mori.engines.kvevents import KVEventSubscriber
from mori.engines.kvindex import KVBlockIndex
from mori.engines.label_channel import LabelChannelDown, LabelRefused
from mori.engines.plugin_link import PluginLink, plugin_residency
from mori.protocol.fields import CHAT, MESSAGES, RESPONSES

log = logging.getLogger(__name__)

PLUGIN_CAPABILITIES = frozenset({Capability.LABELS, Capability.DROP})
"""What an adapter declares while the engine's MORI plug-in answers."""


def tokenize_payload(body: dict[str, Any]) -> dict[str, Any] | None:
    """The tokenize request for a chat or completion body (vLLM's schema: ``model`` with
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


def warmup_body(body: dict[str, Any], path: str = CHAT) -> dict[str, Any]:
    """A copy of a request that asks for the fewest output tokens its API allows, not
    streamed (a warm-up): one (chat, completions, Messages), 16 (Responses' least
    ``max_output_tokens``)."""
    warm = copy.deepcopy(body)
    warm["stream"] = False
    warm.pop("stream_options", None)
    if path == RESPONSES:
        warm["max_output_tokens"] = 16
        return warm
    warm["max_tokens"] = 1
    if path == MESSAGES:
        return warm
    if "max_completion_tokens" in warm:
        warm["max_completion_tokens"] = 1
    warm["n"] = 1
    return warm


def _prompt_ids(body: dict[str, Any]) -> list[int] | None:
    """A completion prompt given as token ids, else None."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


class KVEventsAdapter(OpenAIHTTPAdapter):
    """An engine that publishes KV events and tokenizes (see the module doc).

    Subclasses name the engine (``engine_name``, for messages), its tokenize endpoint
    (``tokenize_path``), why it may not prefetch (``no_prefetch``), and add their own
    capabilities; ``Capability.RESIDENCY`` is set here when events and an attribution are
    given. ``index`` is the block index (None without ``kv_events``). ``cpu_tokens`` (0:
    as the engine reports) and ``prefetch`` (None: as the engine's host tier allows) are
    the operator's; ``capacity()`` caches what the engine reported in ``_capacity``.
    ``link``: the MORI plug-in's label channel inside the engine, when a subclass sets one
    (``mori.engines.plugin_link``); labels, drops and the label of a released program go
    over it.
    """

    engine_name: ClassVar[str]
    tokenize_path: ClassVar[str]
    no_prefetch: ClassVar[str]

    def __init__(self, url: str, *, timeout_s: float, kv_tokens: int, cpu_tokens: int,
                 page_tokens: int, connect_timeout_s: float, kv_events: str | None,
                 kv_events_topic: str, attribution: str, prefetch: bool | None) -> None:
        super().__init__(url, timeout_s=timeout_s, kv_tokens=kv_tokens,
                         page_tokens=page_tokens, connect_timeout_s=connect_timeout_s)
        self.cpu_tokens = cpu_tokens
        self.prefetch_opt = prefetch
        self._capacity: KVCapacity | None = None
        self.kv_events = kv_events or None
        self.attribution = attribution if self.kv_events else "none"
        self.index: KVBlockIndex | None = None
        self._subscriber: KVEventSubscriber | None = None
        self.link: PluginLink | None = None
        if self.kv_events:
            rules = () if self.attribution == "none" else (self.attribution,)
            self.index = KVBlockIndex(rules)
            self._subscriber = KVEventSubscriber(self.kv_events, self.index, kv_events_topic)
            if self.attribution != "none":
                self.capabilities = self.capabilities | {Capability.RESIDENCY}
        self._events_residency = Capability.RESIDENCY in self.capabilities

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        if self.link is not None:
            await self.link.start()
        await super().start()
        if self._subscriber is not None:
            await self._subscriber.start()
        try:
            await self.capacity()
        except UpstreamError as e:  # the engine may still be starting: capacity() retries
            log.info("%s %s: capacity not known yet (%s)", self.engine_name, self.url,
                     e.message)

    async def close(self) -> None:
        if self.link is not None:
            await self.link.close()
        if self._subscriber is not None:
            await self._subscriber.close()
        await super().close()

    # -- the MORI plug-in's label channel -------------------------------------------------
    @property
    def labels_up(self) -> bool:
        """Whether the plug-in answers (labels and drops are sent to it)."""
        return self.link is not None and self.link.up

    async def check_labels(self) -> bool:
        """One check of the label channel (``PluginLink.check``); True when the plug-in
        answers."""
        return self.link is not None and await self.link.check()

    def _plugin_up(self, hello: dict[str, Any]) -> None:
        """The plug-in answers: labels and drops go to it, residency too if it tells it."""
        self.capabilities = self.capabilities | PLUGIN_CAPABILITIES
        if self.link is not None and self.link.answers_residency:
            self.capabilities = self.capabilities | {Capability.RESIDENCY}

    def _plugin_down(self) -> None:
        self.capabilities = self.capabilities - PLUGIN_CAPABILITIES
        if not self._events_residency:
            self.capabilities = self.capabilities - {Capability.RESIDENCY}

    def _link(self, what: str) -> PluginLink:
        if self.link is None:
            raise NotSupportedError(f"{self.engine_name} {self.url} {what} only through "
                                    "the MORI plug-in (the labels=ENDPOINT option)")
        return self.link

    async def set_label(self, program_id: str, label: KVLabel) -> None:
        """Label the program's KV; while the plug-in does not answer, the label is only
        recorded (it goes with the table when the plug-in answers again)."""
        await self._link("takes eviction labels").set_label(program_id, label.value)

    async def drop(self, program_id: str) -> None:
        """Let the program's cached KV go (what the engine's plug-in can do of it)."""
        await self._link("drops one program's KV").drop(program_id)

    # -- forwarding and tokens ------------------------------------------------------------
    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        if self.attribution == "tokens" and self.index is not None and hints.program_id:
            ids = await self.tokenize(body)
            if ids is not None:
                self.index.learn_tokens(hints.program_id, ids)
        return await super().forward(path, body, stream, hints)

    async def tokenize(self, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine tokenizes them (a prompt of token ids is
        its own answer); None when the engine cannot tell."""
        ids = _prompt_ids(body)
        if ids is not None:
            return ids
        payload = tokenize_payload(body)
        if payload is None:
            return None
        try:
            data = await self.post_json(self.tokenize_path, payload, timeout_s=30.0)
        except UpstreamError as e:
            log.debug("%s %s%s failed: %s", self.engine_name, self.url, self.tokenize_path,
                      e.message)
            return None
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None

    async def count_prompt_tokens(self, path: str, body: dict[str, Any]) -> int | None:
        if Capability.TOKENIZE not in self.capabilities:
            return None
        ids = await self.tokenize(body)
        return len(ids) if ids is not None else None

    # -- KV controls ---------------------------------------------------------------------
    async def residency(self) -> Residency:
        """From the plug-in while it answers ``residency`` (its own tables, which a
        restarted gateway finds full); else from the KV events."""
        link = self.link
        if link is not None and link.answers_residency:
            try:
                return plugin_residency(await link.channel.residency())
            except LabelChannelDown as e:
                why = str(e)
                link.lost(why)
            except (LabelRefused, ValueError) as e:
                why = str(e)
                log.warning("%s %s: the MORI plug-in's residency is unusable (%s)%s",
                            self.engine_name, self.url, why, "; reading the KV events "
                            "instead" if self._events_residency else "")
            if not self._events_residency:
                raise UpstreamError(f"{self.engine_name} {self.url}: the MORI plug-in did "
                                    f"not tell its residency ({why})", unhealthy=False)
        if self.index is None or self.attribution == "none":
            raise NotSupportedError(f"{self.engine_name} {self.url}: no residency without "
                                    "kv_events and an attribution")
        return self.index.residency()

    async def release(self, program_id: str) -> None:
        if self.index is not None:
            self.index.forget_program(program_id)
        if self.link is not None:
            await self.set_label(program_id, KVLabel.INACTIVE)

    async def prefetch(self, program_id: str, path: str, body: dict[str, Any]) -> None:
        """Warm-up: the program's request with ``max_tokens=1``, not streamed, at priority
        0 (the program is being promoted); its output is discarded. ``UpstreamError`` if
        the engine cannot be reached or refuses it."""
        if Capability.PREFETCH not in self.capabilities:
            raise NotSupportedError(f"{self.engine_name} {self.url} {self.no_prefetch}")
        resp = await self.forward(path, warmup_body(body, path), False,
                                  RequestHints(program_id=program_id))
        await resp.aclose()
        if resp.status >= 400:
            raise UpstreamError(f"{self.engine_name} {self.url} refused the warm-up request "
                                f"({resp.status}): {(resp.body or b'')[:200]!r}",
                                status=resp.status, unhealthy=False)
