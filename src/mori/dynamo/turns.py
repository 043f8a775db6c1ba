"""One turn of a program as Dynamo's frontend hands it to a router, and back.

Dynamo's frontend tokenizes a chat request and passes the router a preprocessed request
(a dict: ``token_ids``, ``stop_conditions``, ``routing``, ...) whose ``agent_context``
carries what the client's headers said of its program: ``session_id``
(``x-dynamo-session-id``), ``parent_session_id`` (``x-dynamo-parent-session-id``, a
subagent's parent) and ``session_final`` (``x-dynamo-session-final``: the program is
done). Here that becomes a ``Turn`` MORI's control loop understands; a request that
cannot be one raises ``TurnError`` saying what was wrong and how to fix it.

``forwarded`` builds the request sent on to the chosen worker (pinned with
``routing.backend_instance_id``, moved up its engine's queue with
``routing.priority_jump``); ``ChunkFacts`` reads what the worker's answer chunks say
(usage, cached tokens, the worker that served it). Nothing here imports Dynamo.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mori.protocol.errors import RequestError
from mori.protocol.fields import DEFAULT_MAX_PROGRAM_ID_BYTES, check_program_id

ONE_OFF_PREFIX = "dynamo-one-off-"
"""The prefix of the ids the router gives requests without a session; reserved: a
client's session id may not start with it (it would join an anonymous request)."""


class TurnError(ValueError):
    """A request that cannot be scheduled as a turn; the message says how to fix it."""


@dataclass(frozen=True, slots=True)
class Turn:
    """What one request says of its program. ``program_id`` None: the request names no
    session (a one-off request: MORI schedules it as a one-step program)."""

    program_id: str | None
    parent: str | None
    final: bool
    prompt_tokens: int


def _session_field(ctx: Mapping[str, Any], key: str, header: str,
                   max_bytes: int) -> str | None:
    value = ctx.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise TurnError(f"agent_context.{key} must be a string, got "
                        f"{type(value).__name__}: send the {header} header as text")
    value = value.strip()
    if not value:
        return None
    if value.startswith(ONE_OFF_PREFIX):
        raise TurnError(f"agent_context.{key} may not start with {ONE_OFF_PREFIX!r}: the "
                        f"router names requests without a session so; send another {header}")
    try:  # the gateway's rules for a program id: size, valid Unicode, no control characters
        return check_program_id(value, max_bytes)
    except RequestError as e:
        rule = e.message.removeprefix("invalid 'program_id': ")
        raise TurnError(f"agent_context.{key} is not a usable program id: {rule}; send "
                        f"another {header}") from None


def read_turn(request: Mapping[str, Any],
              max_id_bytes: int = DEFAULT_MAX_PROGRAM_ID_BYTES) -> Turn:
    """The turn a preprocessed request describes. Raises ``TurnError``."""
    tokens = request.get("token_ids")
    if not isinstance(tokens, list) or not tokens:
        raise TurnError("the request has no token_ids: the MORI router takes tokenized "
                        "requests (register it with ModelInput.Tokens behind Dynamo's "
                        "frontend), and a prompt must have at least one token")
    ctx = request.get("agent_context")
    if ctx is None:
        return Turn(None, None, False, len(tokens))
    if not isinstance(ctx, Mapping):
        raise TurnError(f"agent_context must be an object, got {type(ctx).__name__}")
    pid = _session_field(ctx, "session_id", "x-dynamo-session-id", max_id_bytes)
    parent = _session_field(ctx, "parent_session_id", "x-dynamo-parent-session-id",
                            max_id_bytes)
    final = ctx.get("session_final", False)
    if not isinstance(final, bool):
        raise TurnError("agent_context.session_final must be true or false, got "
                        f"{final!r}")
    if final and pid is None:
        raise TurnError("session_final without a session_id: send x-dynamo-session-id "
                        "with x-dynamo-session-final to say which program ended")
    if parent is not None and parent == pid:
        parent = None  # a program is not its own parent
    return Turn(pid, parent, final, len(tokens))


def forwarded(request: Mapping[str, Any], worker_id: int, priority_jump: float) -> dict[str, Any]:
    """The request sent on: a copy pinned to ``worker_id`` (its data-parallel rank 0 unless
    the request named one), moved ``priority_jump`` seconds up the engine's queue (added to
    any jump it already had)."""
    out = dict(request)
    routing = copy.copy(request.get("routing")) or {}
    if not isinstance(routing, dict):
        routing = {}
    routing["backend_instance_id"] = worker_id
    if not isinstance(routing.get("dp_rank"), int):
        routing["dp_rank"] = int(request.get("dp_rank") or 0)
    if priority_jump > 0:
        earlier = routing.get("priority_jump")
        base = float(earlier) if isinstance(earlier, int | float) else 0.0
        routing["priority_jump"] = base + priority_jump
    out["routing"] = routing
    return out


@dataclass(slots=True)
class ChunkFacts:
    """What a worker's answer said so far: tokens out, the usage it reported, the worker
    that served it."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    reported_output: int | None = None
    worker_id: int | None = None
    finish_reason: str | None = None

    def read(self, chunk: Any) -> None:
        if not isinstance(chunk, Mapping):
            return
        ids = chunk.get("token_ids")
        if isinstance(ids, list):
            self.output_tokens += len(ids)
        reason = chunk.get("finish_reason")
        if isinstance(reason, str):
            self.finish_reason = reason
        usage = chunk.get("completion_usage")
        if isinstance(usage, Mapping):
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            # the first chunk's usage counts its own token; only the last one's the answer
            if isinstance(reason, str) and isinstance(usage.get("completion_tokens"), int):
                self.reported_output = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
        routing = chunk.get("routing_data")
        if isinstance(routing, Mapping) and isinstance(routing.get("worker_id"), Mapping):
            wid = routing["worker_id"].get("decode_worker_id")
            if isinstance(wid, int):
                self.worker_id = wid

    @property
    def completion_tokens(self) -> int:
        return self.reported_output if self.reported_output is not None else self.output_tokens

    def context_tokens(self, prompt_tokens: int) -> int:
        """The program's context after this turn: its prompt and what was generated."""
        return (self.prompt_tokens or prompt_tokens) + self.completion_tokens


def wants_engine_data(request: Mapping[str, Any]) -> bool:
    """Whether the client asked for ``engine_data`` in its answer
    (``nvext.extra_fields``), where the router says what it did with the turn."""
    sources = [request.get("nvext")]
    extra = request.get("extra_args")
    if isinstance(extra, Mapping):
        sources.append(extra.get("nvext"))
    return any(isinstance(s, Mapping) and isinstance(s.get("extra_fields"), list)
               and "engine_data" in s["extra_fields"] for s in sources)


def with_engine_data(chunk: Any, key: str, data: Mapping[str, Any]) -> Any:
    """``chunk`` with ``data`` under ``engine_data[key]`` (chunks that are not objects are
    passed on as they are)."""
    if not isinstance(chunk, dict):
        return chunk
    engine = chunk.get("engine_data")
    engine = dict(engine) if isinstance(engine, Mapping) else (
        {} if engine is None else {"backend": engine})
    engine[key] = dict(data)
    out = dict(chunk)
    out["engine_data"] = engine
    return out
