"""The engine adapter interface: what the gateway needs from an engine replica.

One small async interface (docs/architecture.md): forward a request (streaming or not),
report KV capacity and health, and whatever KV control the engine offers. Each adapter
declares the controls it supports in ``capabilities``; the gateway calls only those.

The gateway forwards bodies with MORI's own request fields (``program_id``, ``mori``:
``mori.protocol.fields``) removed; what an adapter needs of them comes in
``RequestHints``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mori.core.types import Capability as Capability  # re-exported: adapters declare these
from mori.core.types import KVLabel


class NotSupportedError(RuntimeError):
    """The adapter does not offer this control (check ``capabilities`` first)."""


class UpstreamError(Exception):
    """The engine could not serve: refused, timed out, died, or answered garbage.

    ``status`` is what the gateway answers the client (502 bad gateway, 503 unavailable,
    504 timeout); ``unhealthy`` says whether the replica should be marked down.
    """

    def __init__(self, message: str, status: int = 502, unhealthy: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.unhealthy = unhealthy


class ResponseTooLarge(UpstreamError):
    """An answer read whole was over the adapter's ``max_response_bytes``: its
    connection was dropped (the engine aborts the request); 502, the replica stays
    healthy."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=502, unhealthy=False)


DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""The largest answer an engine may send whole (not streamed), by default."""


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """KV capacity of one replica in tokens (``cpu_tokens`` 0: no host tier;
    ``disk_tokens`` 0: no disk tier)."""

    gpu_tokens: int
    cpu_tokens: int = 0
    page_tokens: int = 16
    kv_bytes_per_token: int = 1  # 1 when unknown: the policy then counts tokens
    disk_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Residency:
    """Tokens of KV each program holds per tier, as the engine reports it."""

    gpu_tokens: Mapping[str, int] = field(default_factory=dict)
    cpu_tokens: Mapping[str, int] = field(default_factory=dict)
    ended: frozenset[str] = frozenset()
    """Programs released whose KV the engine still holds (where it can tell): not to be
    taken back as live ones by a restarted gateway."""


@dataclass(frozen=True, slots=True)
class RequestHints:
    """What the gateway tells an adapter about one forwarded request.

    ``priority``: MORI's rank, 0 = most important (busy programs), larger = less; each
    adapter maps it to its engine's convention. ``synthetic``: the ``mori`` field, for
    adapters with ``SYNTHETIC_PROMPTS``.
    """

    program_id: str
    priority: int = 0
    synthetic: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports it is doing: requests running and requests queued (all of
    them, other clients' included)."""

    running: int
    waiting: int

    @property
    def requests(self) -> int:
        return self.running + self.waiting


@dataclass(slots=True)
class UpstreamResponse:
    """An engine's answer. Exactly one of ``body`` (complete JSON bytes) and ``chunks``
    (the SSE byte stream, passed through chunk by chunk) is set. ``aclose`` cancels the
    upstream request (a client went away) or releases the connection."""

    status: int
    headers: dict[str, str]
    body: bytes | None = None
    chunks: AsyncIterator[bytes] | None = None
    _closer: Any = None

    async def aclose(self) -> None:
        if self._closer is not None:
            closer, self._closer = self._closer, None
            await closer()


class EngineAdapter(ABC):
    """One engine replica as the gateway sees it. Build, ``await start()``, use,
    ``await close()``."""

    kind: ClassVar[str]

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.first_byte_timeout_s: float | None = None
        """The longest wait for a forwarded request's answer to begin (its head; for a
        request that is not streamed, the whole answer): set by the gateway
        (``--first-byte-timeout``); None: ``timeout_s``."""
        self.max_response_bytes = DEFAULT_MAX_RESPONSE_BYTES
        """The largest answer read whole from the engine (a forward that is not
        streamed, a control-plane call); beyond it ``ResponseTooLarge``: set by the
        gateway (``--max-response-bytes``)."""
        self.capabilities: frozenset[Capability] = frozenset()
        """The controls this replica offers: set by each adapter when built, and by
        some once the engine has reported its settings."""

    def supports(self, cap: Capability) -> bool:
        return cap in self.capabilities

    async def start(self) -> None:
        """Open connections (called once before use)."""
        return None

    async def close(self) -> None:
        """Close connections."""
        return None

    def abort_requests(self, reason: str) -> int:
        """The gateway gave up on this engine (it hangs or died): end every request in
        flight there at once with an ``UpstreamError`` (503) saying ``reason``. Returns
        how many there were. Default: nothing to abort."""
        return 0

    # -- required ---------------------------------------------------------------------
    @abstractmethod
    async def forward(self, path: str, body: dict[str, Any], stream: bool,
                      hints: RequestHints) -> UpstreamResponse:
        """Send ``body`` (MORI's fields already removed) to ``path`` on the engine.

        Raises ``UpstreamError`` when the engine cannot be reached or fails before
        answering; a non-2xx answer is returned as is (the gateway passes it on)."""

    @abstractmethod
    async def capacity(self) -> KVCapacity: ...

    @abstractmethod
    async def health(self) -> bool:
        """True if the engine answers its health check."""

    @abstractmethod
    async def models(self) -> list[dict[str, Any]]:
        """The engine's ``/v1/models`` entries."""

    # -- optional controls (declared in ``capabilities``) -------------------------------
    async def count_prompt_tokens(self, path: str, body: dict[str, Any]) -> int | None:
        """Exact prompt tokens of a request, or None if the engine cannot tell."""
        return None

    async def set_label(self, program_id: str, label: KVLabel) -> None:
        raise NotSupportedError(f"{self.kind} engines take no eviction labels")

    async def offload(self, program_id: str) -> None:
        raise NotSupportedError(f"{self.kind} engines cannot offload one program")

    async def prefetch(self, program_id: str, path: str, body: dict[str, Any]) -> None:
        raise NotSupportedError(f"{self.kind} engines cannot prefetch one program")

    async def drop(self, program_id: str) -> None:
        raise NotSupportedError(f"{self.kind} engines cannot drop one program")

    async def release(self, program_id: str) -> None:
        """The program ended: its KV is inactive. Default: nothing to tell the engine."""
        return None

    async def residency(self) -> Residency:
        raise NotSupportedError(f"{self.kind} engines report no residency")

    async def load(self) -> EngineLoad | None:
        """The engine's reported load now, or None if it reports none."""
        return None
