"""Talking to the replay target: the HTTP client, what the target is (a probe of its
model list, its ``/v1/programs`` and its ``/metrics``), the gateway's counters, and the kind
a failed request is counted under."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import openai

from mori.replay.config import ReplayConfig
from mori.replay.metrics import GatewayCounters, gateway_counters, is_gateway_metrics

_PROBE_TIMEOUT_S = 10.0


class TargetError(RuntimeError):
    """The target cannot be used: unreachable, or not an OpenAI-compatible server."""


def _http_module() -> Any:
    """The httpx-family module the installed ``openai`` is built on (httpx or httpx2)."""
    cls = openai.DefaultAsyncHttpxClient
    if isinstance(cls, type):
        for c in cls.__mro__:
            if c.__name__ == "AsyncClient":
                return importlib.import_module(c.__module__.partition(".")[0])
    for name in ("httpx2", "httpx"):  # pragma: no cover - depends on the openai version
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("openai's HTTP library (httpx) is not installed")  # pragma: no cover


def http_client(programs: int, timeout_s: float) -> Any:
    """openai's async HTTP client with room for every program's connection at once."""
    hx = _http_module()
    limits = hx.Limits(max_connections=max(1000, 8 * programs),
                       max_keepalive_connections=max(100, 2 * programs))
    return openai.DefaultAsyncHttpxClient(limits=limits,
                                          timeout=hx.Timeout(timeout_s, connect=10.0))


@dataclass(frozen=True, slots=True)
class Target:
    """What the probe found: the model to use, its context window, whether the target is
    a MORI gateway, and the gateway's counters at the start."""

    model: str
    max_model_len: int | None
    gateway: bool
    counters: GatewayCounters | None


async def probe_target(client: openai.AsyncOpenAI, http: Any, cfg: ReplayConfig,
                       headers: dict[str, str]) -> Target:
    """The model to use and what the target is; TargetError if it cannot be reached.

    The model list goes through ``client``, which also readies it for the first request.
    """
    base = cfg.base_url
    try:
        page = await client.models.list(timeout=_PROBE_TIMEOUT_S)
        entries = list(page.data)
    except openai.APIStatusError as e:
        raise TargetError(f"{base}/v1/models answered HTTP {e.status_code}; is {base} an "
                          "OpenAI-compatible server?") from None
    except openai.APIConnectionError as e:
        cause = e.__cause__ or e
        raise TargetError(f"cannot reach {base} ({type(cause).__name__}: "
                          f"{cause or 'no answer'})") from None
    except openai.APIError as e:
        raise TargetError(f"{base}/v1/models did not answer a model list ({e})") from None
    if cfg.model is None and not entries:
        raise TargetError(f"{base} lists no model; pass one with --model")
    model = cfg.model if cfg.model is not None else entries[0].id
    entry = next((m for m in entries if m.id == model), None)
    mml = (entry.model_extra or {}).get("max_model_len") if entry is not None else None
    max_model_len = mml if isinstance(mml, int) and mml > 0 else None
    gateway = False
    metrics_text: str | None = None
    try:
        r = await http.get(f"{base}/v1/programs", headers=headers, timeout=_PROBE_TIMEOUT_S)
        gateway = r.status_code == 200
        r = await http.get(f"{base}/metrics", headers=headers, timeout=_PROBE_TIMEOUT_S)
        if r.status_code == 200:
            metrics_text = r.text
            gateway = gateway or is_gateway_metrics(metrics_text)
    except Exception:
        pass
    counters = gateway_counters(metrics_text) if gateway and metrics_text is not None else None
    return Target(model, max_model_len, gateway, counters)


async def scrape_counters(http: Any, base: str, headers: dict[str, str]
                          ) -> GatewayCounters | None:
    """The gateway's counters now (None if ``/metrics`` does not answer them)."""
    try:
        r = await http.get(f"{base}/metrics", headers=headers, timeout=_PROBE_TIMEOUT_S)
    except Exception:
        return None
    return gateway_counters(r.text) if r.status_code == 200 else None


_HTTP_LIBRARIES = frozenset({"httpx", "httpx2", "httpcore", "httpcore2", "h11", "anyio", "ssl"})


def error_kind(e: BaseException, streaming: bool) -> str:
    """The kind a failed request is counted under (see :class:`ReplayResult`);
    ``streaming``: tokens had arrived when it failed."""
    if isinstance(e, TimeoutError | openai.APITimeoutError):
        return "timeout"
    if isinstance(e, openai.APIStatusError):
        return f"http_{e.status_code}"
    if isinstance(e, openai.APIConnectionError):
        return "stream" if streaming else "connection"
    if isinstance(e, openai.APIError):  # an error event in the stream
        return "stream"
    if isinstance(e, OSError) or type(e).__module__.partition(".")[0] in _HTTP_LIBRARIES:
        return "stream" if streaming else "connection"  # the HTTP library's own error
    return "other"
