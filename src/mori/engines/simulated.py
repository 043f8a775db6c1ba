"""The adapter for the simulated engine (``mori engine-sim``, ``mori.enginesim``).

It speaks the engine-sim's OpenAI API plus its KV controls under ``/mori/v1/``: typed
eviction labels, offload and drop of one program, residency and capacity. The ``mori``
synthetic prompt field travels in the body, the program id in ``X-Program-Id``
(percent-encoded UTF-8, ``mori.protocol.fields.encode_program_id``; in KV-control paths
percent-encoded too); prompts
are counted by the engine-sim's own rule (``mori.protocol.tokens``), without a call.

An engine-sim started with a token (the ones ``mori serve`` starts in-process always
are: a random one only the gateway knows) answers 401 without it; the adapter's
``token`` (``--backend sim=URL,token=TOKEN``, else the environment's
``MORI_ENGINE_TOKEN``) is sent as ``Authorization: Bearer TOKEN`` on every call.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import quote

import aiohttp

from mori.core.types import KVLabel
from mori.engines.base import (
    Capability,
    KVCapacity,
    RequestHints,
    Residency,
    UpstreamError,
)
from mori.engines.http import OpenAIHTTPAdapter
from mori.protocol.errors import RequestError
from mori.protocol.fields import PROGRAM_ID_HEADER, encode_program_id
from mori.protocol.tokens import prompt_tokens

SIM_CAPABILITIES = frozenset({
    Capability.LABELS, Capability.OFFLOAD, Capability.DROP, Capability.RESIDENCY,
    Capability.SYNTHETIC_PROMPTS, Capability.TOKENIZE, Capability.PRIORITY,
    Capability.KV_READY,
})
"""What every simulated engine offers. Not ``PREFETCH``: the engine-sim has no warm-up
call; a request whose prefix sits in the CPU tier reloads it first, and its streams say
when that is done (``KV_READY``)."""


TOKEN_ENV = "MORI_ENGINE_TOKEN"
"""The environment variable holding an engine-sim's token (``mori engine-sim`` reads it
too)."""


class SimEngineAdapter(OpenAIHTTPAdapter):
    """A simulated engine replica served over HTTP. Priority hints are sent (as the
    ``priority`` field) and accepted by the engine, which ignores them."""

    kind = "sim"
    load_gauges = ("mori_engine_requests_running", "mori_engine_requests_waiting")

    def __init__(self, url: str, *, timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0, token: str | None = None) -> None:
        super().__init__(url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        self.capabilities = SIM_CAPABILITIES
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        self.token = None if token is None else str(token)
        self._auth = {} if self.token is None else {"authorization": f"Bearer {self.token}"}

    def session_headers(self) -> dict[str, str]:
        return dict(self._auth)

    # -- request shaping -----------------------------------------------------------------
    def shape_body(self, body: dict[str, Any], hints: RequestHints) -> dict[str, Any]:
        out = dict(body)
        if hints.synthetic is not None:
            out["mori"] = dict(hints.synthetic)
        out["priority"] = hints.priority
        return out

    def request_headers(self, hints: RequestHints) -> dict[str, str]:
        # percent-encoded UTF-8: any id (non-ASCII included) travels as plain ASCII
        return {PROGRAM_ID_HEADER: encode_program_id(hints.program_id), **self._auth}

    async def count_prompt_tokens(self, path: str, body: dict[str, Any]) -> int | None:
        """The engine-sim's own rule: ``mori.prompt_tokens`` if present, else
        ceil(characters / 4) of the text; None for a body it would refuse."""
        try:
            return prompt_tokens(path, body)
        except RequestError:
            return None

    # -- reports ---------------------------------------------------------------------------
    async def capacity(self) -> KVCapacity:
        d = await self.get_json("/mori/v1/capacity")
        try:
            return KVCapacity(gpu_tokens=int(d["gpu_tokens"]), cpu_tokens=int(d["cpu_tokens"]),
                              page_tokens=int(d["page_tokens"]),
                              kv_bytes_per_token=int(d["kv_bytes_per_token"]))
        except (KeyError, TypeError, ValueError) as e:
            raise UpstreamError(f"engine {self.url} sent a bad capacity: {d!r}") from e

    async def residency(self) -> Residency:
        d = await self.get_json("/mori/v1/residency")
        try:
            return Residency(
                gpu_tokens={str(k): int(v) for k, v in d["gpu_tokens"].items()},
                cpu_tokens={str(k): int(v) for k, v in d["cpu_tokens"].items()},
                ended=frozenset(str(k) for k in d.get("ended", ())))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise UpstreamError(f"engine {self.url} sent a bad residency: {d!r}") from e

    # -- KV controls -----------------------------------------------------------------------
    async def set_label(self, program_id: str, label: KVLabel) -> None:
        await self._control(program_id, "label", {"label": label.value})

    async def offload(self, program_id: str) -> None:
        """Move the program's GPU KV to the CPU tier (dropped when there is none); a
        program the engine holds nothing of is left as it is."""
        await self._control(program_id, "offload")

    async def drop(self, program_id: str) -> None:
        await self._control(program_id, "drop")

    async def release(self, program_id: str) -> None:
        await self._control(program_id, "release")

    async def _control(self, program_id: str, action: str,
                       payload: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """POST a KV control; None when the engine does not know the program (404)."""
        path = f"/mori/v1/programs/{quote(program_id, safe='')}/{action}"
        try:
            async with self.session.post(self.url + path, json=payload or {},
                                         timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                if r.status == 404 and await self._unknown_program(r):
                    return None
                if r.status >= 400:
                    raise UpstreamError(f"engine {self.url}{path} answered {r.status}: "
                                        f"{(await r.text())[:200]}", unhealthy=False)
                data = await r.json(content_type=None)
        except aiohttp.ClientError as e:
            raise UpstreamError(f"engine {self.url}{path}: {e}", status=503) from e
        except TimeoutError as e:
            raise UpstreamError(f"engine {self.url}{path} timed out", status=504) from e
        return data if isinstance(data, dict) else None

    @staticmethod
    async def _unknown_program(r: aiohttp.ClientResponse) -> bool:
        try:
            data = await r.json(content_type=None)
        except (ValueError, aiohttp.ClientError):
            return False
        err = data.get("error") if isinstance(data, dict) else None
        return isinstance(err, dict) and err.get("code") == "program_not_found"
