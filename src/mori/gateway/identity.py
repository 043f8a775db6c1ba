"""Which program a request belongs to, with no change to the client: the recognisers.

An unmodified agent does not send ``program_id``; it sends its own session ids. A
*recogniser* is a small named function that reads one client's marks from a request's
headers and body and returns an ``Identity`` (or None: not this client). The gateway
tries the recognisers in order (``--program-id-from``, default ``DEFAULT_ORDER``) and
takes the first answer; a request none recognises is anonymous (a one-step program).

=================  ===========  ===================================================
recogniser         agent        reads
=================  ===========  ===================================================
``program-id``     client       body ``program_id``, else header ``X-Program-Id``
``claude-code``    claude-code  header ``X-Claude-Code-Session-Id``, else the
                                ``session_id`` of ``metadata.user_id`` (a JSON string;
                                older CLIs: ``..._session_<id>``) where Claude Code's
                                own headers are there (``CLAUDE_CODE_MARKS``); a
                                subagent's context from ``x-claude-code-agent-id``
``metadata-user``  client       the ``session_id`` of ``metadata.user_id`` from any
                                other client (the ``anthropic`` SDK)
``codex``          codex        header ``session-id`` (or ``session_id``,
                                ``conversation_id``), else ``thread-id``; the context
                                window from ``x-codex-window-id``
``prompt-cache-key`` openai     body ``prompt_cache_key`` (OpenAI's Responses and chat)
``opencode``       opencode     header ``X-Session-Id`` where opencode sent it
                                (``User-Agent: opencode/...``, or ``x-session-affinity``
                                the same ``ses_...`` id); a subagent's parent session
                                from ``x-parent-session-id``
``session-header`` client       header ``X-Session-Id``
``conversation``   client       the conversation itself: a request that extends a
                   (gemini-cli) known program's last prompt and answer continues it
                                (``mori.gateway.conversations``); the last resort.
                                Its agent is ``gemini-cli`` where Gemini CLI sent it
                                (``User-Agent: GeminiCLI...``), which names no session
=================  ===========  ===================================================

**One session is not one program.** MORI's unit is one growing context. An explicit
``program_id`` is taken as the client gives it. A recognised session is split: its
program is ``<agent>:<session>/<context>``, where ``<context>`` is the context the
client names (Codex's window id, Claude Code's subagent id) or, failing that, a short hash of the text the
conversation starts with (``mori.protocol.apis.conversation_head``: the system prompt and
the first user message). Every request of one conversation has the same head; a
subagent (its own system prompt and task) or a conversation compacted into a summary
starts another program of the same session. The session is kept beside the id, so
``/v1/programs`` and the recorded trace can group a session's programs. Where the client
names a program's parent (Claude Code's ``x-claude-code-parent-agent-id`` for a subagent
started by a subagent, Codex's ``x-codex-parent-thread-id``), ``Recognised.parent`` says
which; otherwise the gateway infers it (``mori.gateway.sessions``). An opencode subagent
is a session of its own that names its parent session (``x-parent-session-id``): its
parent is the program of that session that was last active (``parent_session``).

A session id that is no valid program id, or longer than ``MAX_SESSION_CHARS``, is
replaced by a hash of itself (a client is never refused for its own session ids). The
id then goes into the caller's key namespace like an explicit one
(``mori.gateway.auth``): no client reaches another key's programs by sending its
session id.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mori.core.registry import Registry
from mori.gateway.conversations import ConversationIndex
from mori.protocol.apis import ApiSpec, conversation_head
from mori.protocol.errors import RequestError
from mori.protocol.fields import check_program_id

MAX_SESSION_CHARS = 128
"""The longest session id kept as sent; a longer one is replaced by its hash."""
HEAD_HASH_HEX = 10
"""Hex digits of the conversation head's hash in a program id."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What a recogniser found: the ``session`` as the client names it, the ``agent``
    kind, and the ``window`` (a context the client names itself; None: split by the
    conversation's head). ``split`` False: ``session`` is the program id itself."""

    session: str
    agent: str
    window: str | None = None
    split: bool = True
    parent_window: str | None = None  # the parent's context, where the client names it
    parent_session: str | None = None  # the parent's session, where it is another one


@dataclass(frozen=True, slots=True)
class Seen:
    """What a recogniser may read of a request: its headers (lower-case names, values
    as sent, latin-1 decoded), its body, the validated explicit program id."""

    headers: Mapping[bytes, str]
    body: Mapping[str, Any]
    program_id: str | None
    spec: ApiSpec | None = None  # the API the body is in (the conversation recogniser)
    conversations: ConversationIndex | None = None  # None: no conversation recogniser
    namespace: str = ""  # the caller's key namespace ("" without keys)


Recogniser = Callable[[Seen], Identity | None]

CONVERSATION = "conversation"
"""The recogniser that tells programs apart by their conversation (no session named)."""
CLAUDE_CODE_MARKS = frozenset((b"x-app", b"user-agent", b"anthropic-beta"))
"""The headers by which Claude Code is told from other Anthropic clients: ``x-app: cli``,
``User-Agent: claude-cli/...``, an ``anthropic-beta`` that lists ``claude-code-...``.
The ``anthropic`` SDK sends none of them, so its ``metadata.user_id`` names a ``client``
program (``metadata-user``), not a Claude Code one."""


GEMINI_CLI_AGENT = "GeminiCLI"
"""How Gemini CLI's ``User-Agent`` starts (``GeminiCLI/0.61.0/<model> (...)``, or
``GeminiCLI-<client>/...``)."""


@dataclass(frozen=True, slots=True)
class Recognised:
    """A request's program as the gateway names it (before the key's namespace):
    ``program_id``, the ``session`` it belongs to, the ``recogniser`` and ``agent``
    (``anonymous`` for neither: ``program_id`` is None then)."""

    program_id: str | None
    session: str | None
    recogniser: str
    agent: str
    parent: str | None = None  # the parent's program id, or a prefix of it (ends in ":"
    # within the session, in "/" for a parent in another session: ``parent_session``)
    parent_session: str | None = None


ANONYMOUS = Recognised(None, None, "anonymous", "anonymous")


def _explicit(seen: Seen) -> Identity | None:
    return None if seen.program_id is None else Identity(seen.program_id, "client",
                                                        split=False)


_OLD_CLAUDE_USER = re.compile(r"_session_([0-9A-Za-z-]+)$")


def _metadata_session(seen: Seen) -> str | None:
    """The session named in ``metadata.user_id`` (Claude Code's JSON string, or an older
    CLI's ``..._session_<id>``)."""
    meta = seen.body.get("metadata")
    user = meta.get("user_id") if isinstance(meta, Mapping) else None
    if not isinstance(user, str):
        return None
    session = _json_session(user)
    if session is None and (m := _OLD_CLAUDE_USER.search(user)) is not None:
        session = m.group(1)
    return session


def is_claude_code(headers: Mapping[bytes, str]) -> bool:
    """Whether the request carries Claude Code's own headers (``CLAUDE_CODE_MARKS``)."""
    return (headers.get(b"x-app") == "cli"
            or headers.get(b"user-agent", "").startswith("claude-cli/")
            or "claude-code-" in headers.get(b"anthropic-beta", ""))


def _claude_code(seen: Seen) -> Identity | None:
    session = seen.headers.get(b"x-claude-code-session-id")
    if not session and is_claude_code(seen.headers):
        session = _metadata_session(seen)
    if not session:
        return None
    h = seen.headers
    return Identity(session, "claude-code", window=h.get(b"x-claude-code-agent-id") or None,
                    parent_window=h.get(b"x-claude-code-parent-agent-id") or None)


def _json_session(text: str) -> str | None:
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    sid = obj.get("session_id") if isinstance(obj, dict) else None
    return sid if isinstance(sid, str) and sid else None


def _codex(seen: Seen) -> Identity | None:
    h = seen.headers
    session = (h.get(b"session-id") or h.get(b"session_id") or h.get(b"conversation_id")
               or h.get(b"thread-id"))
    if not session:
        return None
    parent = h.get(b"x-codex-parent-thread-id")
    return Identity(session, "codex", window=h.get(b"x-codex-window-id") or None,
                    parent_window=f"{parent}:" if parent else None)


def _prompt_cache_key(seen: Seen) -> Identity | None:
    key = seen.body.get("prompt_cache_key")
    return Identity(key, "openai") if isinstance(key, str) and key else None


def _metadata_user(seen: Seen) -> Identity | None:
    session = _metadata_session(seen)
    return Identity(session, "client") if session else None


def _opencode(seen: Seen) -> Identity | None:
    h = seen.headers
    session = h.get(b"x-session-id")
    if not session or not (h.get(b"user-agent", "").startswith("opencode/") or (
            session.startswith("ses_") and h.get(b"x-session-affinity") == session)):
        return None
    return Identity(session, "opencode",
                    parent_session=h.get(b"x-parent-session-id") or None)


def _session_header(seen: Seen) -> Identity | None:
    session = seen.headers.get(b"x-session-id")
    return Identity(session, "client") if session else None


def _conversation(seen: Seen) -> Identity | None:
    index = seen.conversations
    if index is None or seen.spec is None:
        return None
    program = index.program(seen.spec, seen.body, seen.namespace)
    agent = "gemini-cli" if seen.headers.get(b"user-agent", "").startswith(
        GEMINI_CLI_AGENT) else "client"
    return None if program is None else Identity(program, agent, split=False)


def _build() -> Registry[Recogniser]:
    reg: Registry[Recogniser] = Registry("program-id recogniser")
    reg.register("program-id", _explicit)
    reg.register("claude-code", _claude_code)
    reg.register("codex", _codex)
    reg.register("prompt-cache-key", _prompt_cache_key)
    reg.register("metadata-user", _metadata_user)
    reg.register("opencode", _opencode)
    reg.register("session-header", _session_header)
    reg.register(CONVERSATION, _conversation)
    reg.freeze()
    return reg


RECOGNISERS = _build()
"""Every recogniser, by name (frozen)."""

DEFAULT_ORDER = ("program-id", "claude-code", "codex", "prompt-cache-key", "metadata-user",
                 "opencode", "session-header", CONVERSATION)
"""The order the recognisers are tried in unless ``--program-id-from`` says otherwise."""

HEADERS_READ = frozenset((b"x-program-id", b"x-claude-code-session-id",
                          b"x-claude-code-agent-id", b"x-claude-code-parent-agent-id",
                          b"x-codex-parent-thread-id", b"session-id",
                          b"session_id", b"conversation_id", b"thread-id",
                          b"x-codex-window-id", b"x-session-id",
                          b"x-session-affinity", b"x-parent-session-id", b"user-agent")) | CLAUDE_CODE_MARKS
"""The request headers the recognisers read (the endpoint collects only these)."""


def parse_order(names: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Recogniser names from a comma-separated list (or a list); ``ValueError`` naming
    the valid ones for an unknown or repeated name, or none at all."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out = tuple(n.strip() for n in items if n.strip())
    if not out:
        raise ValueError("--program-id-from needs at least one recogniser; valid: "
                         + ", ".join(RECOGNISERS.names()))
    for n in out:
        RECOGNISERS.get(n)  # raises, listing the valid names
    if len(set(out)) != len(out):
        raise ValueError(f"--program-id-from names a recogniser twice: {','.join(out)}")
    return out


def _safe(part: str) -> str:
    """``part`` if it can stand in a program id, else a hash of it."""
    if len(part) <= MAX_SESSION_CHARS:
        try:
            return check_program_id(part, MAX_SESSION_CHARS * 4)
        except RequestError:
            pass
    return "h" + hashlib.sha256(part.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def head_hash(spec: ApiSpec, body: Mapping[str, Any]) -> str:
    """A short hash of the conversation's head (see the module doc)."""
    head = conversation_head(spec, body)
    return hashlib.sha256(head.encode("utf-8", "surrogatepass")).hexdigest()[:HEAD_HASH_HEX]


def recognise(order: tuple[str, ...], spec: ApiSpec, seen: Seen) -> Recognised:
    """The request's program by the first recogniser in ``order`` that knows it."""
    for name in order:
        ident = RECOGNISERS.get(name)(seen)
        if ident is None:
            continue
        if not ident.split:  # the program itself; a conversation names no session
            return Recognised(ident.session, None if name == CONVERSATION else ident.session,
                              name, ident.agent)
        session = _safe(ident.session)
        context = _safe(ident.window) if ident.window else head_hash(spec, seen.body)
        parent = None
        if ident.parent_window:
            pw = _safe(ident.parent_window)
            parent = f"{ident.agent}:{session}/{pw}" if pw == ident.parent_window else None
        parent_session = _safe(ident.parent_session) if ident.parent_session else None
        if parent_session is not None and parent_session != session:
            parent = f"{ident.agent}:{parent_session}/"  # any program of that session
        else:
            parent_session = None
        return Recognised(f"{ident.agent}:{session}/{context}", session, name, ident.agent,
                          parent, parent_session)
    return ANONYMOUS
