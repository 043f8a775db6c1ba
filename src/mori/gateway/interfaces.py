"""What the completion path needs of a gateway process, whether it holds the policy
(``mori.gateway.app.Gateway``) or asks the process that does (``mori.gateway.worker_process``).
"""

from __future__ import annotations

from typing import Any, Protocol

from mori.engines.base import EngineAdapter, UpstreamError
from mori.gateway.agents import RequestFacts, StepFacts
from mori.gateway.aliases import ModelAliases
from mori.gateway.auth import KeyRing
from mori.gateway.config import GatewaySettings
from mori.gateway.token_ratio import TokenRatio


class LeaseLike(Protocol):
    """One admitted request (``mori.gateway.lease.RequestLease`` and its remote twin)."""

    program_id: str
    prompt_tokens: int

    @property
    def adapter(self) -> EngineAdapter: ...

    @property
    def priority(self) -> int: ...

    async def prepare(self, path: str, body: dict[str, Any], stream: bool) -> None: ...

    def kv_ready(self) -> None: ...

    def answering(self) -> None:
        """The engine's first byte came: its prefill is over."""

    def failed(self, e: UpstreamError) -> None: ...

    def finish(self, context_tokens: int, step: StepFacts | None = None) -> None: ...


class Admitter(Protocol):
    """Admission: the controller, or the link to the process that holds it."""

    def wall(self) -> float: ...

    async def lease(self, program_id: str, prompt_tokens: int, anonymous: bool = False,
                    facts: RequestFacts | None = None) -> LeaseLike: ...


class Serving(Protocol):
    """A gateway process as the completion path sees it."""

    settings: GatewaySettings
    adapters: list[EngineAdapter]
    keys: KeyRing
    models: list[dict[str, Any]]
    model_ids: frozenset[str]
    metrics: Any  # GatewayMetrics, or a worker's tally of the same names
    aliases: ModelAliases
    token_ratio: TokenRatio

    @property
    def ctl(self) -> Admitter: ...

    def gpu_tokens(self) -> int: ...

    def anonymous_id(self) -> str: ...

    async def refresh_models(self) -> None: ...
