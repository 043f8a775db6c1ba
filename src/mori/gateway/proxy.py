"""Serving one model call (any API of ``mori.protocol.apis``): admit it, forward it,
pass the answer back.

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

from starlette.responses import JSONResponse, Response

from mori.core.types import Capability
from mori.engines.base import RequestHints, UpstreamError
from mori.gateway.agents import RequestFacts, StepFacts
from mori.gateway.answers import Answer, read_answer, watcher_for
from mori.gateway.held import GateRejected
from mori.gateway.parsing import ClientRequest, estimate_prompt_tokens
from mori.protocol.apis import stream_error
from mori.protocol.errors import clip
from mori.protocol.fields import CHAT, COMPLETIONS, RESPONSES
from mori.protocol.responses import EventStream, PassThrough, api_error_response

if TYPE_CHECKING:
    from mori.gateway.interfaces import LeaseLike
    from mori.gateway.interfaces import Serving as Gateway

log = logging.getLogger("mori.gateway")


async def resolve_model(gw: Gateway, req: ClientRequest) -> Response | None:
    """Map the asked model onto a served one (``--model-alias``; the body is rewritten);
    the API's not-found error when neither served nor mapped (None: go on)."""
    if not gw.model_ids:  # the engines did not say: pass the name on
        return None
    target = gw.aliases.resolve(req.model, gw.model_ids)
    if target is None:
        await gw.refresh_models()
        target = gw.aliases.resolve(req.model, gw.model_ids)
    if target is None:
        served = ", ".join(m["id"] for m in gw.models)
        hint = " (map it with --model-alias PATTERN=SERVED)" if req.spec.anthropic or \
            req.spec.path == RESPONSES else ""
        return api_error_response(req.spec, 404, f"the model {clip(req.model)!r} does not exist; "
                                  f"served: {served}{hint}", "model", "model_not_found")
    if target != req.model:
        req.body["model"] = req.model = target
    return None


async def serve_completion(gw: Gateway, req: ClientRequest, anonymous: bool,
                           facts: RequestFacts | None = None) -> Response:
    """The gateway's answer to one parsed model call, whose ``program_id`` is the
    gateway's id (namespaced; made up for an ``anonymous`` one-step program); ``facts``:
    what the request says of its agent."""
    ctl = gw.ctl
    spec = req.spec
    if (refused := await resolve_model(gw, req)) is not None:
        return refused
    pid = req.program_id
    assert pid is not None, "the endpoint names every request's program"
    tokens = await prompt_tokens(gw, req)
    if tokens > gw.gpu_tokens():
        return api_error_response(spec, 400, f"the prompt ({tokens} tokens) does not fit the "
                                  f"GPU KV capacity of one replica ({gw.gpu_tokens()} tokens)",
                                  "messages", "context_length_exceeded")
    arrived = ctl.wall()
    try:
        lease = await ctl.lease(pid, tokens, anonymous, facts)
    except GateRejected as e:
        return api_error_response(spec, e.status, e.message, "program_id", None,
                                  e.retry_after_s)
    try:
        await lease.prepare(req.path, req.body, req.stream)
        hints = RequestHints(pid, priority=lease.priority, synthetic=req.synthetic)
        up = await lease.adapter.forward(req.path, req.body, req.stream, hints)
    except UpstreamError as e:
        lease.failed(e)
        lease.finish(tokens)
        return api_error_response(spec, e.status, for_client(e, lease.adapter.url), None,
                                  None, gw.settings.retry_after_s if e.status == 503 else None)
    except BaseException:
        lease.finish(tokens)
        raise
    if up.chunks is None:
        gw.metrics.ttft.observe(ctl.wall() - arrived)
        body = up.body or b""

        def step_ended() -> None:  # once the answer is on its way: it waits for nothing
            ans = read_answer(spec, body) if up.status == 200 else Answer(completion_tokens=0)
            used = ans.prompt_tokens
            prompt = used if used is not None and req.synthetic is None else tokens
            out = ans.completion_tokens or 0
            _count(gw, prompt, out)
            lease.finish(prompt + out, StepFacts(prompt, ans.cached_tokens, out,
                                                 tuple(ans.tool_names)))

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


async def serve_count_tokens(gw: Gateway, req: ClientRequest) -> Response:
    """``/v1/messages/count_tokens``: no model call, so not gated. The first engine that
    counts answers (an exact count); where none does (no such path, or unreachable),
    the gateway's estimate (``mori.protocol.tokens``)."""
    if (refused := await resolve_model(gw, req)) is not None:
        return refused
    for a in gw.adapters:
        try:
            up = await a.forward(req.path, req.body, False, RequestHints(""))
        except UpstreamError:
            continue
        if up.status not in (404, 405, 501) and up.body is not None:
            return PassThrough(up.status, up.body, up.headers)
    n = estimate_prompt_tokens(req)
    return JSONResponse({"input_tokens": n})


async def _relay(gw: Gateway, chunks: AsyncIterator[bytes], aclose: Callable[[], Awaitable[None]],
                 lease: LeaseLike, req: ClientRequest, arrived: float
                 ) -> AsyncGenerator[bytes, None]:
    watcher = watcher_for(req.spec)
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
        if not watcher.ended:  # cut off where the body has no framing: the client is told
            raise UpstreamError(f"engine {lease.adapter.url} ended its stream before its "
                                "answer's end", unhealthy=False)
    except UpstreamError as e:
        lease.failed(e)
        yield stream_error(req.spec, 502, for_client(e, lease.adapter.url))
    except (asyncio.CancelledError, GeneratorExit):
        gw.metrics.disconnects.inc()
        raise
    except Exception:  # a fault of the gateway's own: the stream still ends in an error
        log.exception("program %s: relaying the stream failed", req.program_id)
        yield stream_error(req.spec, 502, "the gateway failed mid-stream")
    finally:
        with contextlib.suppress(Exception):
            await aclose()
        ans = watcher.answer
        prompt = lease.prompt_tokens
        if ans.prompt_tokens is not None and req.synthetic is None:
            prompt = ans.prompt_tokens
        out = watcher.output_tokens()
        _count(gw, prompt, out)
        lease.finish(prompt + out, StepFacts(prompt, ans.cached_tokens, out,
                                             tuple(ans.tool_names)))


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
    if gw.settings.exact_tokens and req.path in (CHAT, COMPLETIONS):
        for a in gw.adapters:
            if a.supports(Capability.TOKENIZE):
                with contextlib.suppress(UpstreamError, Exception):
                    n = await a.count_prompt_tokens(req.path, req.body)
                    if n is not None:
                        return max(1, n)
                break
    return estimate_prompt_tokens(req)
