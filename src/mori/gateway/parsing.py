"""Reading a client's request: validation, MORI's own fields, prompt size.

A request's program id is the body's ``program_id`` (a string) or the ``X-Program-Id``
header (its bytes read as UTF-8; the body wins when both are given, and both are
validated): 1 to ``max_program_id_bytes`` bytes of UTF-8, no control character, not
starting with the reserved ``anon-`` (``mori.protocol.fields.check_program_id``). A
request with neither is served as its own one-step program (an id ``anon-<random hex>``
is made up for it and the program ends with its response).

The body is JSON (``decode_body``): at most ``MAX_JSON_DEPTH`` levels of nesting, integer
literals of at most ``MAX_INT_DIGITS`` digits, no lone UTF-16 surrogate escapes; its size
is bounded before (``max_body_bytes``). Whatever the bytes, parsing raises nothing but
``RequestError`` (400).

A Gemini API request (``mori.protocol.gemini``) names its model in the path and is
translated here: ``body`` is the chat completion the engine gets (``path`` the chat
path), ``sent`` the body as the client sent it, which the program's recognisers read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import msgspec

from mori.protocol.apis import API_BY_PATH, ApiSpec, api_for_path, check_body, output_limit
from mori.protocol.errors import RequestError
from mori.protocol.fields import (
    CHAT,
    COMPLETIONS,
    DEFAULT_MAX_PROGRAM_ID_BYTES,
    program_id_field,
    program_id_header,
    synthetic_field,
)
from mori.protocol.gemini.request import count_request, to_chat
from mori.protocol.gemini.routes import gemini_route
from mori.protocol.tokens import text_prompt_tokens

__all__ = ["CHAT", "COMPLETIONS", "MAX_INT_DIGITS", "MAX_JSON_DEPTH", "ClientRequest",
           "decode_body", "estimate_prompt_tokens", "max_output_tokens", "parse_request"]

MAX_JSON_DEPTH = 128
"""The deepest nesting of arrays and objects a request body may have (the top level is 1;
a chat body with tool schemas needs a few dozen at most)."""
MAX_INT_DIGITS = 100
"""The most digits an integer literal of a request body may have."""
_INT_BOUND = 10 ** MAX_INT_DIGITS
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))


@dataclass(slots=True)
class ClientRequest:
    path: str  # the engine's path
    body: dict[str, Any]  # MORI's fields removed: what the engine gets
    program_id: str | None
    stream: bool
    model: str
    synthetic: dict[str, Any] | None  # the ``mori`` field, validated
    spec: ApiSpec  # the API it came in on
    sent: dict[str, Any] | None = None  # the client's body, where ``body`` translates it
    estimated: int | None = None  # its size from its text, where the gateway estimated it

    @property
    def client_body(self) -> dict[str, Any]:
        """The body as the client sent it (MORI's fields removed)."""
        return self.body if self.sent is None else self.sent

    @property
    def engine_spec(self) -> ApiSpec:
        """The API the engine is asked in (and answers in)."""
        return API_BY_PATH.get(self.path, self.spec)


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body; ``RequestError`` (400) for anything that is not
    JSON within the limits of the module doc (and nothing else, whatever the bytes)."""
    try:
        body = msgspec.json.decode(raw)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.ValidationError:  # a number beyond what can be represented
        raise RequestError(400, "the request body holds a number out of range: integers "
                           f"may have at most {MAX_INT_DIGITS} digits, and numbers must be "
                           "finite") from None
    except msgspec.DecodeError as e:
        hint = ""
        if _SURROGATE_ESCAPE.search(raw):
            hint = (" (a \\uD800-\\uDFFF escape must be half of a surrogate pair: a lone "
                    "surrogate is not a character)")
        raise RequestError(400, f"the request body is not valid JSON: {e}{hint}") from None
    if may_break_limits(raw):
        _check_tree(body)
    return body


def may_break_limits(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` could nest deeper than ``MAX_JSON_DEPTH`` or hold an
    integer longer than ``MAX_INT_DIGITS``: each level opens with a bracket and such an
    integer is a run of digits, so a body with fewer brackets and no such run cannot
    (brackets and digits inside strings count too: the test errs towards a full check).
    Most bodies pass it, and are then not walked."""
    return (raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
            or _LONG_DIGITS.search(raw) is not None)


def _too_deep() -> RequestError:
    return RequestError(400, "the request body is nested too deeply: at most "
                        f"{MAX_JSON_DEPTH} levels of arrays and objects")


def _check_tree(body: Any) -> None:
    """``RequestError`` if ``body`` nests deeper than ``MAX_JSON_DEPTH`` or holds an
    integer of more than ``MAX_INT_DIGITS`` digits. Scalars are looked at in bulk (C
    loops): a long prompt of token ids costs little."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if type(node) is dict:
            values: Any = node.values()
        elif type(node) is list:
            values = node
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        types = set(map(type, values))
        if int in types:
            ints = values if len(types) == 1 else [x for x in values if type(x) is int]
            if max(ints) >= _INT_BOUND or min(ints) <= -_INT_BOUND:
                raise RequestError(400, "the request body holds an integer of more than "
                                   f"{MAX_INT_DIGITS} digits")
        if dict in types or list in types:
            stack.extend((x, depth + 1) for x in values if type(x) is dict or type(x) is list)


def parse_request(path: str, raw: bytes, header_program: str | bytes | None,
                  max_program_id_bytes: int = DEFAULT_MAX_PROGRAM_ID_BYTES,
                  query: bytes = b"") -> ClientRequest:
    """The client's request: ``raw`` its body, ``header_program`` its ``X-Program-Id``
    header (the ASGI bytes, or as Starlette gives it: latin-1 decoded), ``query`` its
    query string. ``RequestError`` for bad input (``mori.protocol.apis.check_body`` for
    the API's shape, ``mori.protocol.gemini.request`` for the Gemini API's)."""
    spec = api_for_path(path)
    if spec is None:
        raise RequestError(404, f"the gateway serves no {path!r}")
    body = decode_body(raw)
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if not spec.gemini:
        check_body(spec, body)
    pid = program_id_field(body.pop("program_id", None), max_program_id_bytes)
    from_header = program_id_header(header_program, max_program_id_bytes)
    if pid is None:
        pid = from_header
    sizes = body.pop("mori", None)
    synthetic: dict[str, Any] | None = None
    if sizes is not None:
        synthetic = dict(synthetic_field(sizes))
        if "prompt_tokens" in synthetic and synthetic.get("reuse_tokens", 0) > synthetic[
                "prompt_tokens"]:
            raise RequestError(400, "'mori.reuse_tokens' exceeds 'mori.prompt_tokens'", "mori")
    if spec.gemini:
        return _gemini(path, spec, body, pid, synthetic, query)
    return ClientRequest(path, body, pid, body.get("stream") is True, body["model"],
                         synthetic, spec)


def _gemini(path: str, spec: ApiSpec, body: dict[str, Any], pid: str | None,
            synthetic: dict[str, Any] | None, query: bytes) -> ClientRequest:
    """A Gemini API request, its body translated to the chat completion the engine gets
    (``countTokens``: the request it counts)."""
    route = gemini_route(path)
    assert route is not None, "a Gemini spec comes from a Gemini path"
    if spec.streams and "sse" not in parse_qs(query.decode("latin-1")).get("alt", []):
        raise RequestError(400, "streamGenerateContent is served as server-sent events "
                           "only: add '?alt=sse'", "alt")
    counted = count_request(body) if not spec.generates else body
    chat = to_chat(counted, route.model, spec.streams)
    return ClientRequest(CHAT, chat, pid, spec.streams, route.model, synthetic, spec, body)


def estimate_prompt_tokens(req: ClientRequest) -> int:
    """Prompt size from the text, by the simulated engine's rule
    (``mori.protocol.tokens``, not strict: an estimate, never an error)."""
    return text_prompt_tokens(req.path, req.body, strict=False)


def max_output_tokens(req: ClientRequest) -> int | None:
    return output_limit(req.spec, req.body)
