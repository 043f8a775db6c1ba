"""Serving one completion request: admit it, forward it, pass the answer back.

The controller's ``RequestLease`` covers the request from admission to its end; this
module only moves bytes and counts tokens: it checks the model, sizes the prompt, takes
the lease, forwards the body through the replica's adapter and relays the answer
(chunk by chunk for streams), then finishes the lease with the context the engine
reported (or the gateway's estimate). A stream whose client stops reading for
``stream_write_timeout_s`` is cut off: the engine's request is aborted (its connection
closed) and the lease finished, so the program is Acting again and may retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.responses import Response

from mori.core.types import Capability
from mori.engines.base import RequestHints, UpstreamError
from mori.gateway.gate import GateRejected
from mori.gateway.parsing import ClientRequest, StreamWatcher, estimate_prompt_tokens, usage_tokens
from mori.protocol.errors import sse_error
from mori.protocol.responses import EventStream, PassThrough, error_response

if TYPE_CHECKING:
    from mori.gateway.serving import LeaseLike
    from mori.gateway.serving import Serving as Gateway

log = logging.getLogger("mori.gateway")


async def serve_completion(gw: Gateway, req: ClientRequest, anonymous: bool) -> Response:
    """The gateway's answer to one parsed completion request, whose ``program_id`` is
    the gateway's id (namespaced; made up for an ``anonymous`` one-step program)."""
    ctl = gw.ctl
    if gw.model_ids and req.model not in gw.model_ids:
        await gw.refresh_models()
        if req.model not in gw.model_ids:
            return error_response(404, f"the model {req.model!r} does not exist; served: "
                                  + ", ".join(m["id"] for m in gw.models), "model",
                                  "model_not_found")
    pid = req.program_id
    assert pid is not None, "the endpoint names every request's program"
    tokens = await prompt_tokens(gw, req)
    if tokens > gw.gpu_tokens():
        return error_response(400, f"the prompt ({tokens} tokens) does not fit the GPU KV "
                              f"capacity of one replica ({gw.gpu_tokens()} tokens)",
                              "messages", "context_length_exceeded")
    arrived = ctl.wall()
    try:
        lease = await ctl.lease(pid, tokens, anonymous)
    except GateRejected as e:
        return error_response(e.status, e.message, "program_id", None, e.retry_after_s)
    try:
        await lease.prepare(req.path, req.body, req.stream)
        hints = RequestHints(pid, priority=lease.priority, synthetic=req.synthetic)
        up = await lease.adapter.forward(req.path, req.body, req.stream, hints)
    except UpstreamError as e:
        lease.failed(e)
        lease.finish(tokens)
        return error_response(e.status, for_client(e, lease.adapter.url), None, None,
                              gw.settings.retry_after_s if e.status == 503 else None)
    except BaseException:
        lease.finish(tokens)
        raise
    if up.chunks is None:
        gw.metrics.ttft.observe(ctl.wall() - arrived)
        body = up.body or b""

        def step_ended() -> None:  # once the answer is on its way: it waits for nothing
            p_used, c_used = usage_tokens(body) if up.status == 200 else (None, 0)
            prompt = p_used if p_used is not None and req.synthetic is None else tokens
            _count(gw, prompt, c_used or 0)
            lease.finish(prompt + (c_used or 0))

        return PassThrough(up.status, body, up.headers, after=step_ended)
    relay = _relay(gw, up.chunks, up.aclose, lease, req, arrived)
    await anext(relay)  # started: closing it now always ends the lease

    def stalled() -> None:
        gw.metrics.stream_timeouts.inc()
        log.warning("program %s: the client read nothing for %g s; stream cut off, engine "
                    "request aborted", pid, gw.settings.stream_write_timeout_s)

    return EventStream(up.status, up.headers, relay,
                       write_timeout_s=gw.settings.stream_write_timeout_s,
                       on_write_timeout=stalled)


async def _relay(gw: Gateway, chunks: AsyncIterator[bytes], aclose: Callable[[], Awaitable[None]],
                 lease: LeaseLike, req: ClientRequest, arrived: float
                 ) -> AsyncGenerator[bytes, None]:
    watcher = StreamWatcher()
    first = True
    try:
        yield b""  # taken by serve_completion, to start the generator
        async for chunk in chunks:
            if first:
                gw.metrics.ttft.observe(gw.ctl.wall() - arrived)
                first = False
            watcher.feed(chunk)
            if watcher.kv_ready:
                lease.kv_ready()
            yield chunk
    except UpstreamError as e:
        lease.failed(e)
        yield sse_error(502, for_client(e, lease.adapter.url))
    except (asyncio.CancelledError, GeneratorExit):
        gw.metrics.disconnects.inc()
        raise
    finally:
        with contextlib.suppress(Exception):
            await aclose()
        prompt = lease.prompt_tokens
        if watcher.prompt_tokens is not None and req.synthetic is None:
            prompt = watcher.prompt_tokens
        out = watcher.output_tokens()
        _count(gw, prompt, out)
        lease.finish(prompt + out)


def for_client(e: UpstreamError, url: str) -> str:
    """What a client is told of an engine failure: what happened, without the engine's
    address or the transport's own words (the gateway's log and ``/healthz``, for an
    admin, have both). ``engine http://10.0.0.5:8001 refused the connection: Cannot
    connect to host 10.0.0.5:8001 ...`` becomes ``the engine refused the connection``."""
    head = e.message.split(": ", 1)[0]
    head = head.replace(f"engine {url}", "the engine").replace(url, "the engine")
    return head if url not in head and "://" not in head else f"the engine failed ({e.status})"


def _count(gw: Gateway, prompt: int, completion: int) -> None:
    gw.metrics.prompt_tokens.inc(prompt)
    gw.metrics.completion_tokens.inc(completion)


async def prompt_tokens(gw: Gateway, req: ClientRequest) -> int:
    """The request's prompt size: the synthetic size, an engine's exact count (with
    ``exact_tokens``), or the gateway's estimate."""
    if req.synthetic is not None and "prompt_tokens" in req.synthetic:
        return max(1, int(req.synthetic["prompt_tokens"]))
    if gw.settings.exact_tokens:
        for a in gw.adapters:
            if a.supports(Capability.TOKENIZE):
                with contextlib.suppress(UpstreamError, Exception):
                    n = await a.count_prompt_tokens(req.path, req.body)
                    if n is not None:
                        return max(1, n)
                break
    return estimate_prompt_tokens(req)
