"""The completion endpoints as a bare ASGI handler: the gateway's per-request path.

Every completion passes here, so this path skips what the rest of the app gets from
Starlette (routing, middleware, request objects): ``GatewayApp`` hands ``POST`` to the
completion paths (every API of ``mori.protocol.apis``) straight to
``CompletionEndpoint``. It checks the caller's key (``mori.gateway.auth``), reads the
body within ``max_body_bytes``, parses it
(``mori.gateway.parsing``), maps the program id into the caller's namespace and serves it
(``mori.gateway.proxy``), while watching for the client to leave: a client that
disconnects before its answer starts has its request cancelled (held: it stays held in
the policy and, forwarded with nobody waiting, ends without reaching the engine; running
upstream: the engine's request is aborted). Streams watch their client themselves
(``EventStream``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from mori.gateway.agents import RequestFacts
from mori.gateway.auth import Access, BrowserPolicy
from mori.gateway.conversations import ConversationIndex
from mori.gateway.identity import CONVERSATION, HEADERS_READ, Seen, recognise
from mori.gateway.parsing import ClientRequest, parse_request
from mori.gateway.proxy import serve_completion, serve_count_tokens
from mori.protocol.apis import (
    API_BY_PATH,
    ApiSpec,
    api_for_path,
    carries_tool_results,
    is_side_request,
    last_turn_text,
)
from mori.protocol.errors import RequestError, clip
from mori.protocol.gemini.routes import is_gemini_path
from mori.protocol.responses import (
    JSON_ERROR_HANDLERS,
    api_error_response,
    request_error_response,
    send_server_error,
    spec_for_path,
    transport_of,
)

if TYPE_CHECKING:
    from mori.gateway.interfaces import Serving

log = logging.getLogger("mori.gateway")

FAST_PATHS = frozenset(API_BY_PATH)
"""The completion paths (with the Gemini API's, ``is_gemini_path``)."""
WATCH_AFTER_S = 0.05
"""How long a request runs before the gateway starts watching for its client to leave."""
_WANTED = frozenset((b"authorization", b"x-api-key", b"x-goog-api-key",
                     b"content-length")) | HEADERS_READ
UNKNOWN_GEMINI = "/v1beta/models/{model}:(other)"
"""The metrics label of a Gemini API method the gateway does not serve."""


def credentials(headers: dict[bytes, str]) -> str | None:
    """The request's key as an ``Authorization`` value: the header itself, or the
    Messages API's ``x-api-key`` (Anthropic's clients send the key there), or the Gemini
    API's ``x-goog-api-key`` (Google's)."""
    auth = headers.get(b"authorization")
    if auth is None and (key := headers.get(b"x-api-key") or headers.get(b"x-goog-api-key")):
        auth = "Bearer " + key
    return auth


class ClientGone(Exception):
    """The client disconnected before its request was answered."""


def unauthorized(message: str = "a valid API key is required: send 'Authorization: Bearer "
                 "KEY' (or, on /v1/messages, 'x-api-key: KEY'; on the Gemini API, "
                 "'x-goog-api-key: KEY')",
                 spec: ApiSpec | None = None) -> Response:
    resp = api_error_response(spec, 401, message, None, "invalid_api_key")
    resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


class CompletionEndpoint:
    """Every model-calling path of ``mori.protocol.apis`` (an ASGI app): chat and
    completions, Anthropic's Messages and its token counting, OpenAI's Responses, the
    Gemini API's methods. Errors come in the shape of the API the request came in on."""

    __slots__ = ("gw", "_counters", "_loop", "_conversations")

    def __init__(self, gw: Serving) -> None:
        self.gw = gw
        self._counters: dict[tuple[str, int], Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # the conversation recogniser's index (mori.gateway.conversations), this process's
        self._conversations = (ConversationIndex(gw.settings.program_ttl_s)
                               if CONVERSATION in gw.settings.program_id_from else None)

    def _count(self, path: str, status: int) -> None:
        c = self._counters.get((path, status))
        if c is None:
            c = self._counters[(path, status)] = self.gw.metrics.requests.labels(
                path, str(status))
        c.inc()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gw
        path: str = scope["path"]
        spec = api_for_path(path)
        if spec is None:  # a Gemini API method not served
            self._count(UNKNOWN_GEMINI, 404)
            await api_error_response(spec_for_path(path), 404, "the gateway serves no "
                                     f"{clip(path)!r}: only generateContent, "
                                     "streamGenerateContent and countTokens")(
                                         scope, receive, send)
            return
        label = spec.path  # one metrics label per API, whatever model a path names
        headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in _WANTED}
        principal = gw.keys.identify(credentials(headers))
        if principal.access is Access.NONE:
            self._count(label, 401)
            await unauthorized(spec=spec)(scope, receive, send)
            return
        s = gw.settings
        try:
            raw = await read_body(receive, headers.get(b"content-length"), s.max_body_bytes)
            req = parse_request(path, raw, headers.get(b"x-program-id"),
                                principal.id_limit(s.max_program_id_bytes),
                                scope.get("query_string", b""))
        except RequestError as e:
            self._count(label, e.status)
            await request_error_response(spec, e)(scope, receive, send)
            return
        except ClientGone:
            self._count(label, 499)
            return
        loop = self._loop
        if loop is None:  # kept: get_running_loop makes a system call (mori.engines.http1_client)
            loop = self._loop = asyncio.get_running_loop()
        conversation = None
        if not spec.generates:
            work = serve_count_tokens(gw, req)
        else:
            facts, conversation = self._name_program(req, headers, principal.internal,
                                                     principal.tag)
            work = serve_completion(gw, req, facts.recogniser == "anonymous" or facts.side,
                                    facts)
        try:
            resp = await unless_client_leaves(receive, work, loop)
            if resp is None:  # the client left: nobody to answer
                self._count(label, 499)
                return
            self._count(label, resp.status_code)
            await resp(scope, receive, send)
        finally:
            if conversation is not None and self._conversations is not None:
                # its answer is over (or never came): its next request may continue it
                self._conversations.done(principal.tag, conversation)


    def _name_program(self, req: ClientRequest, headers: dict[bytes, str],
                      internal: Callable[[str], str], namespace: str = ""
                      ) -> tuple[RequestFacts, str | None]:
        """Name the request's program (``mori.gateway.identity``; in the caller's key
        namespace, ``internal``) and say what the request tells of its agent; and the
        program the conversation recogniser named (busy in its index until its request
        ends), None where another recogniser named it."""
        gw = self.gw
        body = req.client_body  # as the client sent it: a Gemini API request's contents
        rec = recognise(gw.settings.program_id_from, req.spec,
                        Seen(headers, body, req.program_id, req.spec, self._conversations,
                             namespace))
        # a side request of a recognised program (not one the client names): a one-step
        # program of its own, which no other request of the session can run into
        side = (rec.program_id is not None and rec.recogniser != "program-id"
                and is_side_request(req.spec, body))
        req.program_id = internal(rec.program_id if rec.program_id and not side
                                  else gw.anonymous_id())
        session = rec.session if rec.recogniser != "program-id" else None
        text = None
        if gw.settings.record_text:
            # no more than the recorder keeps of a program travels on (to the policy
            # process, from a worker): one character past the cap, so that the recorder
            # still sees the text was longer and marks the cut
            text = last_turn_text(req.spec, body)[:gw.settings.record_text_max_bytes + 1]
        facts = RequestFacts(rec.recogniser, rec.agent,
                             None if session is None else internal(session),
                             carries_tool_results(req.spec, body), text,
                             None if rec.parent is None else internal(rec.parent),
                             None if rec.parent_session is None
                             else internal(rec.parent_session), side)
        return facts, rec.program_id if rec.recogniser == CONVERSATION else None


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The whole request body; ``RequestError`` 413 beyond ``limit`` bytes, ``ClientGone``
    if the client disconnects first."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the request body ({declared} bytes) exceeds the gateway's "
                           f"limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            raise ClientGone
        body: bytes = msg.get("body", b"")
        size += len(body)
        if size > limit:
            raise RequestError(413, f"the request body exceeds the gateway's limit of "
                               f"{limit} bytes")
        chunks.append(body)
        if not msg.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def unless_client_leaves(receive: Receive, work: Coroutine[Any, Any, Response],
                               loop: asyncio.AbstractEventLoop | None = None
                               ) -> Response | None:
    """``work``'s answer, or None if the client disconnects first (its body is read, so
    the next message is the disconnect): ``work``, run in this task, is cancelled then
    where it waits. If this handler is cancelled otherwise (the server stops), the
    cancellation goes on.

    The watch starts ``WATCH_AFTER_S`` after the work does: most answers that come at
    once (a trivial upstream, an error) are sent before, and skip the task it takes. A
    client that left in that time is seen when it starts (its disconnect is kept)."""
    if loop is None:
        loop = asyncio.get_running_loop()
    me = asyncio.current_task(loop)
    assert me is not None
    gone = False
    watch: asyncio.Future[Message] | None = None

    def on_message(w: asyncio.Future[Message]) -> None:
        nonlocal gone
        if not w.cancelled() and w.exception() is None \
                and w.result().get("type") == "http.disconnect":
            gone = True
            me.cancel()

    def start_watch() -> None:
        nonlocal watch
        waiting = receive()
        watch = (loop.create_task(waiting) if asyncio.iscoroutine(waiting)
                 else asyncio.ensure_future(waiting, loop=loop))
        watch.add_done_callback(on_message)

    timer = loop.call_later(WATCH_AFTER_S, start_watch)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone or me.cancelling() > 1:
            raise  # cancelled by someone else as well
        me.uncancel()
        return None
    finally:
        timer.cancel()
        if watch is not None:
            watch.remove_done_callback(on_message)
            if not watch.done():
                watch.cancel()


class GatewayApp(Starlette):
    """The Starlette app, with ``POST`` to the completion paths served by ``endpoint``
    before any routing or middleware (the same endpoint is also routed, for methods).

    Every request first passes the gateway's browser policy (``BrowserPolicy``, from its
    keys and settings): refused with 403 where it applies, CORS answered for the
    configured origins. Every error is JSON in the API's shape: Starlette's 404 and 405,
    and a handler that fails (500) on the completion paths as on the others."""

    def __init__(self, endpoint: CompletionEndpoint, **kwargs: Any) -> None:
        kwargs.setdefault("exception_handlers", dict(JSON_ERROR_HANDLERS))
        super().__init__(**kwargs)
        self.endpoint = endpoint
        s = endpoint.gw.settings
        policy = BrowserPolicy.of(endpoint.gw.keys, s.cors_origins, s.allowed_hosts)
        self.browser = policy if policy.active else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.browser is not None:
                guarded = await self._browser(scope, receive, send)
                if guarded is None:  # answered
                    return
                send = guarded
            if scope["method"] == "POST" and (scope["path"] in FAST_PATHS
                                              or is_gemini_path(scope["path"])):
                try:
                    await self.endpoint(scope, receive, send)
                except Exception:
                    if not await send_server_error(scope, receive, send):
                        raise  # the answer had started: the server logs it and closes
                    log.exception("%s failed", scope["path"])
                return
        await super().__call__(scope, receive, send)

    async def _browser(self, scope: Scope, receive: Receive, send: Send) -> Send | None:
        """Apply the browser policy: None once the request is answered (refused, or a
        CORS preflight), else the ``send`` to go on with (adding the CORS headers for an
        allowed origin)."""
        policy = self.browser
        assert policy is not None
        host = origin = preflight = asked = None
        for k, v in scope["headers"]:
            if k == b"host":
                host = v.decode("latin-1")
            elif k == b"origin":
                origin = v.decode("latin-1")
            elif k == b"access-control-request-method":
                preflight = v
            elif k == b"access-control-request-headers":
                asked = v
        server = scope.get("server")
        refused = policy.refusal(host, origin, str(server[0]) if server else None)
        if refused is not None:
            code, message = refused
            await api_error_response(spec_for_path(scope["path"]), 403, message, None, code,
                                     type_="permission_error")(scope, receive, send)
            return None
        if origin is None or not policy.cors_allows(origin):
            return send
        allow = [(b"access-control-allow-origin", origin.encode("latin-1")),
                 (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and preflight is not None:
            headers = [*allow, (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                       (b"access-control-max-age", b"600"), (b"content-length", b"0")]
            if asked is not None:
                headers.append((b"access-control-allow-headers", asked))
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return None
        return _CorsSend(send, [*allow, (b"access-control-expose-headers", _EXPOSED)])


_EXPOSED = b"Retry-After, WWW-Authenticate"
"""The answer headers a page allowed by CORS may read besides the plain ones."""


class _CorsSend:
    """A ``send`` that adds CORS headers to the answer's start (and, like uvicorn's,
    leads to the connection's ``transport``: ``mori.protocol.responses.transport_of``)."""

    __slots__ = ("_send", "_headers", "transport")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self._headers = headers
        self.transport = transport_of(send)

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *self._headers]}
        await self._send(message)
