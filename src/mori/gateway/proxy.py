"""Serving one model call (any API of ``mori.protocol.apis``): admit it, forward it,
pass the answer back.

The controller's ``RequestLease`` covers the request from admission to its end; this
module only moves bytes and counts tokens: it checks the model, sizes the prompt, takes
the lease, forwards the body through the replica's adapter and relays the answer
(whole lines at a time for streams), then finishes the lease with the context the
engine reported (or the gateway's estimate), clamped to what one request can hold. A
stream whose client stops reading for ``stream_write_timeout_s`` is cut off: the
engine's request is aborted (its connection closed) and the lease finished, so the
program is Acting again and may retry. What an engine sends is bounded too (``_Relay``):
one SSE line of at most ``max_sse_line_bytes``, no wait for its next byte over
``stream_idle_timeout_s``.

A Gemini API request (``mori.protocol.gemini``) reaches the engine as its chat
translation; the engine's answer is read as a chat answer and passed back translated to
the Gemini API's shape (a stream event by event).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from starlette.responses import JSONResponse, Response

from mori.core.types import Capability
from mori.engines.base import RequestHints, ResponseTooLarge, UpstreamError, UpstreamResponse
from mori.gateway.agents import RequestFacts, StepFacts
from mori.gateway.answers import Answer, StepUsage, read_answer, watcher_for
from mori.gateway.held import AdmissionRejected
from mori.gateway.idle_watch import IdleWatch
from mori.gateway.parsing import ClientRequest, estimate_prompt_tokens, max_output_tokens
from mori.protocol.apis import stream_error
from mori.protocol.errors import clip
from mori.protocol.fields import CHAT, COMPLETIONS, RESPONSES
from mori.protocol.gemini.response import translate_answer
from mori.protocol.gemini.stream import GeminiStream
from mori.protocol.responses import EventStream, PassThrough, api_error_response
from mori.protocol.sse import LineTooLong

if TYPE_CHECKING:
    from mori.gateway.interfaces import LeaseLike, Serving

log = logging.getLogger("mori.gateway")


async def resolve_model(gw: Serving, req: ClientRequest) -> Response | None:
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
            req.spec.gemini or req.spec.path == RESPONSES else ""
        return api_error_response(req.spec, 404, f"the model {clip(req.model)!r} does not exist; "
                                  f"served: {served}{hint}", "model", "model_not_found")
    if target != req.model:
        req.body["model"] = req.model = target
    return None


async def serve_completion(gw: Serving, req: ClientRequest, anonymous: bool,
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
    arrived = ctl.wall()  # before the prompt is counted: an engine's /tokenize is in its TTFT
    tokens = await prompt_tokens(gw, req)
    if tokens > gw.gpu_tokens():
        return api_error_response(spec, 400, f"the prompt ({tokens} tokens) does not fit the "
                                  f"GPU KV capacity of one replica ({gw.gpu_tokens()} tokens)",
                                  "messages", "context_length_exceeded")
    try:
        lease = await ctl.lease(pid, tokens, anonymous, facts)
    except AdmissionRejected as e:
        return api_error_response(spec, e.status, e.message, "program_id", None,
                                  e.retry_after_s)
    try:
        await lease.prepare(req.path, req.body, req.stream)
        hints = RequestHints(pid, priority=lease.priority, synthetic=req.synthetic)
        up = await lease.adapter.forward(req.path, req.body, req.stream, hints)
    except UpstreamError as e:
        if isinstance(e, ResponseTooLarge):
            gw.metrics.responses_too_large.inc()
        lease.failed(e)
        lease.finish(tokens)
        return api_error_response(spec, e.status, for_client(e, lease.adapter.url), None,
                                  None, gw.settings.retry_after_s if e.status == 503 else None)
    except BaseException:
        lease.finish(tokens)
        raise
    if up.chunks is None:
        lease.answering()
        gw.metrics.ttft.observe(ctl.wall() - arrived)
        body = up.body or b""

        def step_ended() -> None:  # once the answer is on its way: it waits for nothing
            ans = read_answer(req.engine_spec, body) if up.status == 200 \
                else Answer(completion_tokens=0)
            _book(gw, lease, req, ans, ans.completion_tokens or 0)

        if spec.gemini:
            status, out = translate_answer(up.status, body)
            headers = {**up.headers, "content-type": "application/json"}
            return PassThrough(status, out, headers, after=step_ended)
        return PassThrough(up.status, body, up.headers, after=step_ended)
    stream = _Relay(gw, up, lease, req, arrived)
    relay = stream.run()
    # the first whole lines: until they come, the client can be answered with a status
    first = await anext(relay, None)  # started: closing it now always ends the lease
    if first is None:
        await relay.aclose()
        err = stream.refused
        assert err is not None, "a relay that passed nothing on was refused"
        return api_error_response(spec, err.status, for_client(err, lease.adapter.url), None,
                                  None, gw.settings.retry_after_s if err.status == 503 else None)

    def stalled() -> None:
        gw.metrics.stream_timeouts.inc()
        log.warning("program %s: the client read nothing for %g s; stream cut off, engine "
                    "request aborted", pid, gw.settings.stream_write_timeout_s)

    return EventStream(up.status, up.headers, relay, first=first,
                       write_timeout_s=gw.settings.stream_write_timeout_s,
                       on_write_timeout=stalled)


async def serve_count_tokens(gw: Serving, req: ClientRequest) -> Response:
    """``/v1/messages/count_tokens``: no model call, so never held. The first engine that
    counts answers (an exact count); where none does (no such path, or unreachable),
    the gateway's estimate (``mori.protocol.tokens``). The Gemini API's ``countTokens``:
    the prompt size of its chat translation (``prompt_tokens``)."""
    if (refused := await resolve_model(gw, req)) is not None:
        return refused
    if req.spec.gemini:
        return JSONResponse({"totalTokens": await prompt_tokens(gw, req)})
    for a in gw.adapters:
        try:
            up = await a.forward(req.path, req.body, False, RequestHints(""))
        except UpstreamError:
            continue
        if up.status not in (404, 405, 501) and up.body is not None:
            return PassThrough(up.status, up.body, up.headers)
    n = estimate_prompt_tokens(req)
    return JSONResponse({"input_tokens": n})


class _Relay:
    """One streamed answer passed on (``run``), whole lines at a time: the engine's
    bytes up to their last line end, each chunk as it comes (``mori.gateway.answers``
    reads them on the way and holds the start of a line until its end arrives; a long
    line is then passed on in the pieces it came in).

    A stream cut off mid-line loses the partial line (an SSE client would drop it too),
    so the error event that follows is read as one. Bounds: a line over ``max_sse_line_bytes`` ends the stream (502); so does an engine
    that sends nothing for ``stream_idle_timeout_s`` (504; before the first byte,
    ``first_byte_timeout_s``), and the replica is probed. Either way the engine's
    request is aborted (its connection dropped), the step ends, and the client gets an
    error event in its API's shape, or, if nothing was passed on yet, ``refused`` is
    set and ``run`` ends without a chunk: the caller answers with that status.
    """

    __slots__ = ("gw", "up", "lease", "req", "arrived", "refused")

    def __init__(self, gw: Serving, up: UpstreamResponse, lease: LeaseLike,
                 req: ClientRequest, arrived: float) -> None:
        self.gw = gw
        self.up = up
        self.lease = lease
        self.req = req
        self.arrived = arrived
        self.refused: UpstreamError | None = None

    async def run(self) -> AsyncGenerator[bytes, None]:
        gw, lease, req = self.gw, self.lease, self.req
        settings = gw.settings
        watcher = watcher_for(req.engine_spec, settings.max_sse_line_bytes)
        # the client's API, where the engine's stream is translated to it
        gemini = GeminiStream() if req.spec.gemini else None
        assert self.up.chunks is not None
        chunks = aiter(self.up.chunks)
        loop = asyncio.get_running_loop()
        idle = IdleWatch(loop)
        limit = settings.first_byte_timeout_s
        first = True
        sent = False
        open_event = False  # the last bytes passed on left an event without its blank line
        try:
            while True:
                idle.arm(limit)
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    if not idle.timed_out():
                        raise
                    raise self._idle_error(first, idle.limit) from None
                finally:
                    idle.disarm()
                if first:
                    lease.answering()
                    gw.metrics.ttft.observe(gw.ctl.wall() - self.arrived)
                    first = False
                    limit = settings.stream_idle_timeout_s
                pieces = watcher.feed(chunk)
                if watcher.kv_ready:
                    lease.kv_ready()
                if pieces and gemini is not None:
                    out = gemini.feed(b"".join(pieces))
                    pieces = [out] if out else []
                if pieces:
                    sent = True
                    open_event = not pieces[-1].endswith((b"\n\n", b"\n\r\n"))
                    for piece in pieces:  # a long line's as they came: no pass over it
                        yield piece
            rest = watcher.rest()  # a last line with no end: dropped unless the answer ended
            if gemini is not None and watcher.ended:
                rest = gemini.feed(rest) + gemini.last()
            if watcher.ended and rest:
                yield rest
            if not watcher.ended:  # cut off where the body has no framing: the client is told
                raise UpstreamError(f"engine {lease.adapter.url} ended its stream before its "
                                    "answer's end", unhealthy=False)
        except (UpstreamError, LineTooLong) as exc:
            e = exc if isinstance(exc, UpstreamError) else self._line_error(exc)
            lease.failed(e)
            if sent:  # after a blank line: an event of its own
                yield b"\n" * open_event + stream_error(req.spec, e.status,
                                                        for_client(e, lease.adapter.url))
            else:
                self.refused = e
        except (asyncio.CancelledError, GeneratorExit):
            gw.metrics.disconnects.inc()
            raise
        except Exception:  # a fault of the gateway's own: the stream still ends in an error
            log.exception("program %s: relaying the stream failed", req.program_id)
            if sent:
                yield b"\n" * open_event + stream_error(req.spec, 502,
                                                        "the gateway failed mid-stream")
            else:
                self.refused = UpstreamError("the gateway failed mid-stream")
        finally:
            idle.stop()
            with contextlib.suppress(Exception):
                await self.up.aclose()  # the engine's request aborted unless it ended
            ans = watcher.answer
            _book(gw, lease, req, ans, watcher.output_tokens())

    def _idle_error(self, first: bool, seconds: float) -> UpstreamError:
        """The engine sent nothing in time: counted, and a 504 that has the replica
        probed (not marked down: a slow engine is not a dead one)."""
        m = self.gw.metrics
        m.stream_timeouts.inc()
        m.upstream_idle_timeouts.inc()
        url = self.lease.adapter.url
        what = "began no answer" if first else "sent nothing mid-stream"
        flag = "--first-byte-timeout" if first else "--stream-idle-timeout"
        return UpstreamError(f"engine {url} {what} for {seconds:g} s ({flag})", status=504,
                             unhealthy=False)

    def _line_error(self, e: LineTooLong) -> UpstreamError:
        self.gw.metrics.sse_lines_too_long.inc()
        return UpstreamError(f"engine {self.lease.adapter.url} sent an SSE line over "
                             f"{e.limit} bytes (--max-sse-line-bytes; the request was "
                             f"aborted): {e}", status=502, unhealthy=False)


def for_client(e: UpstreamError, url: str) -> str:
    """What a client is told of an engine failure: what happened, without the engine's
    address or the transport's own words (the gateway's log and ``/healthz``, for an
    admin, have both). ``engine http://10.0.0.5:8001 refused the connection: Cannot
    connect to host 10.0.0.5:8001 ...`` becomes ``the engine refused the connection``."""
    head = e.message.split(": ", 1)[0]
    head = head.replace(f"engine {url}", "the engine").replace(url, "the engine")
    return head if url not in head and "://" not in head else f"the engine failed ({e.status})"


def _book(gw: Serving, lease: LeaseLike, req: ClientRequest, ans: Answer,
          output: int) -> None:
    """End the step with its counts: the engine's (its prompt count unless the request
    is synthetic, whose size the gateway knows) else the gateway's estimate, clamped to
    what one request can hold (``StepUsage.bounded``; a clamp is counted and logged)."""
    prompt = lease.prompt_tokens
    engine_prompt = ans.prompt_tokens is not None and req.synthetic is None
    if engine_prompt:
        prompt = ans.prompt_tokens  # type: ignore[assignment]
    context = context_window(gw, req.model)
    out_cap = None if req.synthetic is not None else max_output_tokens(req)
    if context is not None:
        out_cap = context if out_cap is None else min(out_cap, context)
    told = StepUsage(prompt, ans.cached_tokens, output)
    usage = told.bounded(context if engine_prompt else None, out_cap)
    if usage != told:
        gw.metrics.usage_clamped.inc()
        log.warning("program %s on %s: the engine's usage cannot be true (prompt %d, cached "
                    "%s, output %d; the context window is %s tokens, the request's output "
                    "limit %s); booked as prompt %d, cached %s, output %d", req.program_id,
                    lease.adapter.url, told.prompt, told.cached, told.output, context,
                    out_cap, usage.prompt, usage.cached, usage.output)
    if engine_prompt and req.estimated is not None:
        gw.token_ratio.observe(req.model, req.estimated, usage.prompt)
    gw.metrics.prompt_tokens.inc(usage.prompt)
    gw.metrics.completion_tokens.inc(usage.output)
    lease.finish(usage.prompt + usage.output, StepFacts(usage.prompt, usage.cached,
                                                        usage.output, tuple(ans.tool_names)))


def context_window(gw: Serving, model: str) -> int | None:
    """The most tokens one request can hold: one replica's GPU KV capacity, and the
    served model's ``max_model_len`` where its engine reports one (None: unknown)."""
    limits = [gw.gpu_tokens()]
    for m in gw.models:
        n = m.get("max_model_len")
        if m.get("id") == model and isinstance(n, int) and not isinstance(n, bool):
            limits.append(n)
    limits = [n for n in limits if n > 0]
    return min(limits) if limits else None


async def prompt_tokens(gw: Serving, req: ClientRequest) -> int:
    """The request's prompt size: the synthetic size, an engine's exact count (with
    ``exact_tokens``), or the gateway's estimate scaled by what the engines counted for
    earlier estimates (``TokenRatio``)."""
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
    req.estimated = estimate_prompt_tokens(req)
    return gw.token_ratio.scaled(req.model, req.estimated)
