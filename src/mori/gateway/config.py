"""The gateway's settings: one frozen dataclass; the policy's knobs embedded, not copied."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mori.core.policies import POLICIES
from mori.core.policy import PolicyConfig
from mori.engines.base import DEFAULT_MAX_RESPONSE_BYTES
from mori.gateway.aliases import ModelAliases
from mori.gateway.auth import normalize_origin
from mori.gateway.identity import DEFAULT_ORDER, parse_order
from mori.protocol.fields import DEFAULT_MAX_PROGRAM_ID_BYTES, MAX_PROGRAM_ID_BYTES_LIMIT
from mori.protocol.sse import DEFAULT_MAX_SSE_LINE_BYTES

MIN_MAX_RESPONSE_BYTES = 64 * 1024  # below, an ordinary answer or /metrics could not pass


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """What the gateway needs to know (the CLI maps flags and config files onto this).

    ``policy`` and ``policy_config``: the registered policy and its knobs (its
    ``page_tokens`` is replaced by the engines' page size at startup).
    ``time_scale``: policy seconds per wall second. ``max_held``: the most requests
    held at once (beyond: 429). ``hold_timeout_s``: the longest a request is held
    (beyond: 503). ``retry_after_s``: the ``Retry-After`` of 429 and 503 answers.
    ``program_ttl_s``: a program idle (Acting) this long is released (0: never).
    ``abandoned_grace_s``: a context of a session left behind when a newer one began (a
    compaction, a ``/clear``) is released this long after (0: only by ``program_ttl_s``;
    ``mori.gateway.sessions``).
    ``max_body_bytes``: the largest request body (beyond: 413).
    The bounds on every connection (``mori.gateway.bounds``): ``max_header_bytes``, the
    largest request head (beyond: 431); ``header_timeout_s``, the longest a head may take
    (beyond: 408, closed); ``keep_alive_timeout_s``, the longest an idle keep-alive
    connection stays open; ``body_timeout_s``, the longest a body may pause (beyond: 408,
    closed); ``max_connections``, the most connections open in each gateway process (at
    the cap: the longest-idle is closed, or the new one refused with 503).
    ``max_program_id_bytes``: the longest program id, in bytes of UTF-8 (beyond: 400),
    1 to ``MAX_PROGRAM_ID_BYTES_LIMIT`` (1024). ``health_interval_s``:
    how often every replica's engine is probed; ``health_timeout_s``, a probe's deadline;
    ``health_failures``, the probes a healthy replica may miss in a row before it is
    marked unhealthy (its programs then move to other replicas). ``first_byte_timeout_s``:
    the longest a forwarded request waits for its answer to begin (504 beyond, and the
    replica is probed at once). ``max_programs_per_key``: the most live programs one key
    (or, without keys, the gateway) may hold; a new one beyond gets 429 (0: no limit). ``load_interval_s``: how often
    the engines' load is read (requests running and waiting, where an engine reports
    them; 0: never). ``learn_costs``: price each replica's recomputes and reloads by what its
    engine was measured to charge (``mori.core.engine_costs``) once enough requests were
    timed, instead of the configured rates alone. ``exact_tokens``: ask an engine
    that can count prompt tokens exactly. ``decision_log``: decisions kept for
    ``/v1/decisions``. ``startup_wait_s``: how long to wait for engines still starting.
    ``stream_write_timeout_s``: the longest one chunk of a streamed answer may wait for a
    client that stopped reading; beyond it the stream is cut off, the engine's request
    aborted and the program's step ended (it is Acting again and may retry).
    ``stream_idle_timeout_s``: the longest a streamed answer may go without a byte from
    its engine once its first byte came (before it: ``first_byte_timeout_s``); beyond it
    the stream ends with an error event (504 if nothing was passed on yet), the step
    ends and the replica is probed at once. ``max_sse_line_bytes``: the longest line
    an engine's stream may send (beyond it: the stream ends with an error event, or 502
    if nothing was passed on yet, and the engine's request is aborted).
    ``max_response_bytes``: the largest answer an engine may send whole (not streamed),
    and the largest answer to a control-plane call; beyond it the engine's request is
    aborted (its connection dropped) and the client gets a 502.
    ``api_keys`` and ``admin_keys``: the keys of ``mori.gateway.auth`` (none: every
    endpoint open; never shown in the repr). ``public_metrics``: ``/metrics`` without an
    admin key when keys are set. ``cors_origins``: the web origins CORS is answered for
    (and, without keys, let through the Origin check; ``*``: any); ``allowed_hosts``: the
    names, besides the loopback ones and the gateway's address, that the Host check takes
    without keys (``mori.gateway.auth.BrowserPolicy``).
    ``program_id_from``: the recognisers that name a request's program, in the order
    tried (``mori.gateway.identity``). ``model_aliases``: ``PATTERN=SERVED`` rules
    mapping the model names clients ask for onto served ones (``mori.gateway.aliases``).
    ``record``: a trace file every program's steps are appended to (None: none);
    ``record_text``: keep the prompts' text in it, at most ``record_text_max_bytes``
    (UTF-8) a program (``mori.gateway.record``: cut with a marker). ``state``: a file
    the programs' idleness histories are kept in across a restart
    (``mori.gateway.state``; None: none), written every ``state_interval_s`` and at
    shutdown.
    """

    policy: str = "mori"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    time_scale: float = 1.0
    max_held: int = 1024
    hold_timeout_s: float = 300.0
    retry_after_s: float = 5.0
    program_ttl_s: float = 3600.0
    abandoned_grace_s: float = 30.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096
    max_program_id_bytes: int = DEFAULT_MAX_PROGRAM_ID_BYTES
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_failures: int = 2
    first_byte_timeout_s: float = 300.0
    max_programs_per_key: int = 0
    load_interval_s: float = 1.0
    exact_tokens: bool = False
    learn_costs: bool = True
    decision_log: int = 10000
    startup_wait_s: float = 60.0
    stream_write_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 120.0
    max_sse_line_bytes: int = DEFAULT_MAX_SSE_LINE_BYTES
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    public_metrics: bool = False
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    program_id_from: tuple[str, ...] = DEFAULT_ORDER
    model_aliases: tuple[str, ...] = ()
    record: str | None = None
    record_text: bool = False
    record_text_max_bytes: int = 1024 * 1024
    state: str | None = None
    state_interval_s: float = 30.0

    def __post_init__(self) -> None:
        # lists (a config file, a worker's JSON) become tuples; names and rules checked
        object.__setattr__(self, "program_id_from", parse_order(self.program_id_from))
        object.__setattr__(self, "model_aliases", tuple(self.model_aliases))
        ModelAliases.parse(self.model_aliases)
        object.__setattr__(self, "cors_origins", tuple(normalize_origin(o)
                                                       for o in self.cors_origins))
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        if any(not h.strip() or any(c in h for c in "/@ ") for h in self.allowed_hosts):
            raise ValueError(f"allowed_hosts must be host names (got {self.allowed_hosts})")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; valid: {', '.join(POLICIES.names())}")
        for name in ("time_scale", "hold_timeout_s", "health_interval_s",
                     "stream_write_timeout_s", "header_timeout_s", "keep_alive_timeout_s",
                     "body_timeout_s", "health_timeout_s", "first_byte_timeout_s",
                     "state_interval_s", "stream_idle_timeout_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a positive number (got {v})")
        for name in ("retry_after_s", "program_ttl_s", "startup_wait_s", "load_interval_s",
                     "abandoned_grace_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be >= 0 (got {v})")
        if self.max_programs_per_key < 0:
            raise ValueError("max_programs_per_key must be >= 0 (0: no limit; got "
                             f"{self.max_programs_per_key})")
        if self.health_failures < 1:
            raise ValueError(f"health_failures must be >= 1 (got {self.health_failures})")
        if self.max_held < 1:
            raise ValueError(f"max_held must be >= 1 (got {self.max_held})")
        if self.max_sse_line_bytes < 1024:
            raise ValueError(f"max_sse_line_bytes must be >= 1024 (got "
                             f"{self.max_sse_line_bytes})")
        if self.max_response_bytes < MIN_MAX_RESPONSE_BYTES:
            raise ValueError(f"max_response_bytes must be >= {MIN_MAX_RESPONSE_BYTES} (64 KiB; "
                             f"got {self.max_response_bytes})")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024 (got {self.max_body_bytes})")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024 (got {self.max_header_bytes})")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {self.max_connections})")
        if not 1 <= self.max_program_id_bytes <= MAX_PROGRAM_ID_BYTES_LIMIT:
            raise ValueError(f"max_program_id_bytes must be 1 to {MAX_PROGRAM_ID_BYTES_LIMIT} "
                             f"(got {self.max_program_id_bytes})")
        if self.record_text_max_bytes < 0:
            raise ValueError(f"record_text_max_bytes must be >= 0 (got "
                             f"{self.record_text_max_bytes})")
        if self.decision_log < 0:
            raise ValueError(f"decision_log must be >= 0 (got {self.decision_log})")
