"""The options of ``mori simulate`` (also used by ``sweep`` and ``replay``) and of
``mori serve``, declared once for the argument parser and TOML files.

Each :class:`Option` knows its flag, its type, whether it takes a comma-separated list,
its default, its help text and the configuration field it sets; it converts both a
command-line string and a TOML value. Defaults come from the configuration classes
(:class:`~mori.sim.config.SimConfig`, :class:`~mori.core.policy.PolicyConfig`, the
gateway's ``GatewaySettings`` and ``ServeConfig``), so the CLI cannot drift from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mori.core.costmodel import PRESETS
from mori.core.hardware import DISKS
from mori.core.policies import PAPER_POLICIES, POLICIES
from mori.core.policy import DEFAULT_DISK_READ_GBPS, PolicyConfig
from mori.gateway.config import GatewaySettings
from mori.gateway.server import ServeConfig
from mori.sim.config import SimConfig
from mori.sim.workload import HUMAN_GAP_RULES

_SIM = SimConfig()
_POLICY = PolicyConfig()
_GATEWAY = GatewaySettings()
_SERVE = ServeConfig()
POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyConfig))
"""The fields of :class:`PolicyConfig`: an option whose ``target`` is one is a policy knob."""
_KIND_WORDS: dict[type, tuple[str, str]] = {
    int: ("an integer", "integers"), float: ("a number", "numbers"),
    str: ("a string", "strings"), bool: ("true or false", "booleans"),
    Path: ("a path (string)", "paths"),
}


class OptionError(ValueError):
    """A value that does not fit its option; the message says what was expected."""


def _toml_type(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
             list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)


@dataclass(frozen=True, slots=True)
class Option:
    """One option: ``key`` is the attribute name and the config-file key; the flag is
    ``--key-with-dashes``. ``field``: the configuration field it sets, when that is not
    ``key`` (``tick`` sets ``tick_s``). ``multi``: a comma-separated list on the command
    line. ``repeat``: the flag may be given several times, each a whole value (commas
    included); a config file gives a string or an array of strings. Both kinds of list
    option take tuples as values."""

    key: str
    kind: type
    default: Any
    help: str
    multi: bool = False
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    field: str | None = None
    repeat: bool = False
    old: tuple[str, ...] = ()
    """Former spellings (keys), still taken as flags and config keys with a warning."""

    @property
    def flag(self) -> str:
        """The long command-line flag."""
        return "--" + self.key.replace("_", "-")

    @property
    def old_flags(self) -> tuple[str, ...]:
        return tuple("--" + k.replace("_", "-") for k in self.old)

    @property
    def target(self) -> str:
        """The name of the configuration field the option sets."""
        return self.field or self.key

    def what(self) -> str:
        """What a valid value looks like, in words."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        one, many = _KIND_WORDS[self.kind]
        if self.repeat:
            return f"{one} or an array of {many}"
        return f"a comma-separated list of {many}" if self.multi else one

    def parse_text(self, text: str) -> Any:
        """The value of a command-line string (a tuple for ``multi`` options; one item
        for ``repeat`` options, which the parser collects)."""
        if not self.multi:
            return self._scalar(text, text)
        items = [t.strip() for t in text.split(",")]
        if not all(items):
            raise OptionError(f"expected {self.what()}, got {text!r}")
        return tuple(self._scalar(t, t) for t in items)

    def from_toml(self, value: object) -> Any:
        """The value of a TOML value; ``multi`` options take an array, a scalar or a comma
        string, ``repeat`` options an array or a scalar (an empty array: none)."""
        if self.repeat:
            items = value if isinstance(value, list) else [value]
            return tuple(self._scalar(v, None) for v in items)
        if not self.multi:
            return self._scalar(value, None)
        if isinstance(value, str):
            return self.parse_text(value)
        items = value if isinstance(value, list) else [value]
        if not items:
            raise OptionError(f"expected {self.what()}, got an empty array")
        return tuple(self._scalar(v, None) for v in items)

    def _scalar(self, value: object, text: str | None) -> Any:
        """Convert one item; ``text`` is the command-line spelling (None for TOML)."""
        kind, got = self.kind, repr(text) if text is not None else _toml_type(value)
        bad = OptionError(f"expected {self.what()}, got {got}")
        if text is not None and kind in (int, float, bool):
            try:
                value = int(text) if kind is int else float(text) if kind is float else None
            except ValueError:
                raise bad from None
        if kind is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if isinstance(value, bool):
            raise bad
        if kind is int:
            if not isinstance(value, int):
                raise bad
            return value
        if kind is float:
            if not isinstance(value, int | float):
                raise bad
            if not math.isfinite(value):
                raise OptionError(f"expected a finite number, got {value}")
            return float(value)
        if not isinstance(value, str) or not value:
            raise bad
        if self.choices is not None and value not in self.choices:
            raise OptionError(f"expected one of {', '.join(self.choices)}, got {value!r}")
        return Path(value) if kind is Path else value


def _default_text(opt: Option) -> str:
    if opt.default is None or opt.default is False or opt.default == ():
        return ""
    items = opt.default if isinstance(opt.default, tuple) else (opt.default,)
    shown = ",".join(format(v, "g") if isinstance(v, float) else str(v) for v in items)
    return f" (default: {shown})"


_VARIANT_KNOBS: tuple[Option, ...] = (
    Option("acting_token_weight", float, _POLICY.acting_token_weight, metavar="W",
           help="thunderagent: weight of an Acting program's tokens in its capacity"),
    Option("acting_token_decay", bool, _POLICY.acting_token_decay,
           help="thunderagent: resume counts an Acting program's tokens as tokens / 2^t, "
                "t the seconds since its step ended (default: off)"),
    Option("reload_gbps", float, _POLICY.reload_gbps, metavar="GB/S",
           help="the engines' KV reload bandwidth from the CPU tier, GB/s per GPU, as "
                "the policies estimate reload times with (default: 25; 0: reloads priced as "
                "never ending, mori parks nobody at once)"),
    Option("recompute_tok_s", float, _POLICY.recompute_tok_s, metavar="TOK/S",
           help="the recompute rate the policies assume (mori prices a drop by it, "
                "mori-yield a yield), tokens/s per replica (default: in mori simulate the "
                "cost model's; in mori serve 20000)"),
    Option("max_wait", float, _POLICY.max_wait_s, metavar="S", field="max_wait_s",
           help="mori and its variants: a request held this many seconds goes ahead of "
                "every other promotion, Acting programs demoted for it (bounded "
                "waiting); 0: no bound, the paper's rule"),
    Option("load_window", float, _POLICY.load_window_s, metavar="S", field="load_window_s",
           help="mori: the time constant of each replica's recent busy share, which "
                "scales the price of a drop (a recompute delays others only while the "
                "engine has work); 0: price drops as if the engine were always busy"),
    Option("fill_idle", bool, _POLICY.fill_idle,
           help="mori: a replica with no step running takes the oldest held request that "
                "can go there at once, its Acting programs leaving for it (work "
                "conservation; default: off)"),
    Option("gpu_overcommit", float, _POLICY.gpu_overcommit, metavar="X",
           help="mori and its variants: fill a GPU tier X times the engine's GPU KV pool "
                "(X >= 1): fewer requests held, the engine evicting the cached KV that "
                "does not fit in MORI's label order, the most idle first (default: 1)"),
    Option("gpu_overcommit_max", float, _POLICY.gpu_overcommit_max, metavar="X",
           help="mori: let the GPU tier follow the engine, up to X times its pool: larger "
                "while requests are held on engines that keep up, halved when the requests "
                "in flight need more KV than the pool (default: 1, a fixed tier)"),
)
"""The knobs of single policies that `mori simulate` and `mori serve` both take."""

OPTIONS: tuple[Option, ...] = (
    Option("policy", str, tuple(PAPER_POLICIES), metavar="A,B,...", multi=True,
           help="policies to compare; one run per policy at every grid point; "
                f"valid: {', '.join(POLICIES.names())} (default: the paper's four, "
                f"{','.join(PAPER_POLICIES)})"),
    Option("programs", int, (20, 50, 80), metavar="N,N,...", multi=True,
           help="numbers of concurrent agentic programs (closed-loop slots) PER REPLICA: "
                "a run simulates this x --replicas programs in all"),
    Option("preset", str, (_SIM.hardware,), metavar="PRESET,...", multi=True,
           old=("hardware",),
           help="hardware presets, one replica each (see `mori presets`); "
                f"valid: {', '.join(PRESETS.names())}"),
    Option("cpu_ratio", float, (_SIM.cpu_ratio,), metavar="R,...", multi=True,
           help="CPU KV tier size as a multiple of the GPU KV capacity (see below)"),
    Option("disk_ratio", float, (_SIM.disk_ratio,), metavar="R,...", multi=True,
           help="disk KV tier of each replica as a multiple of its GPU KV capacity, under "
                "the CPU tier (0: none; policies whose engine has no CPU tier get none)"),
    Option("disk_kv_tokens", int, _SIM.disk_kv_tokens, metavar="TOKENS",
           help="disk KV tier of each replica in tokens; replaces --disk-ratio"),
    Option("disk", str, _SIM.disk, choices=tuple(DISKS.names()), metavar="DRIVE",
           help=f"the drive(s) of the disk tier: {', '.join(DISKS.names())} (see "
                "`mori presets`)"),
    Option("replicas", int, _SIM.replicas, metavar="N",
           help="engine replicas, each with the preset's GPUs and --programs programs"),
    Option("duration", float, _SIM.duration_s, metavar="SECONDS", field="duration_s",
           help="simulated seconds per run"),
    Option("traces", Path, None, metavar="PATH",
           help="trace set: a kv-cache-tester directory or .json file, or a MORI .jsonl[.gz] "
                "file (default: the shipped kv-cache-tester-31 set of Claude Code sessions)"),
    Option("seed", int, _SIM.seed, metavar="N",
           help="random seed (program order and start times)"),
    Option("json", Path, None, metavar="FILE",
           help="also write every run's metrics to FILE as a JSON list, in grid order"),
    Option("plot", Path, None, metavar="FILE.png",
           help="also plot throughput, steps/s and TTFT against programs to FILE.png"),
    Option("timeline", Path, None, metavar="FILE.html",
           help="also write the dashboard's view of the run to FILE.html, one "
                "self-contained page with a time slider (several runs: one file each, "
                "FILE-<policy>-<programs>[-<preset>][-cpu<R>].html)"),
    Option("timeline_frames", int, 300, metavar="N",
           help="instants a --timeline file keeps, evenly over the run"),
    Option("human_gap", str, _SIM.human_gap, choices=HUMAN_GAP_RULES, metavar="RULE",
           help=f"what to do with human think time after a final answer: "
                f"{' or '.join(HUMAN_GAP_RULES)} (see below)"),
    Option("human_gap_cap", float, _SIM.human_gap_cap_s, metavar="S", field="human_gap_cap_s",
           help="cap on a human gap, seconds"),
    Option("max_context", int, None, metavar="TOKENS",
           help="cut programs at this context length in trace tokens (default: the model's "
                "context window / --token-scale)"),
    Option("share_prefix", bool, _SIM.share_prefix,
           help="let programs share their common system-prompt prefix in the KV cache "
                "(default: off)"),
    Option("gpu_kv_tokens", int, _SIM.gpu_kv_tokens, metavar="TOKENS",
           help="GPU KV pool of each replica in tokens, rounded down to the preset's pages "
                "(default: the preset's pool)"),
    Option("cpu_kv_tokens", int, _SIM.cpu_kv_tokens, metavar="TOKENS",
           help="CPU KV tier of each replica in tokens of KV not on the GPU; replaces "
                "--cpu-ratio; 0: none (default: --cpu-ratio x the GPU pool)"),
    Option("token_scale", float, _SIM.token_scale, metavar="S",
           help="engine tokens per trace token: every prompt, reusable prefix and output "
                "length is multiplied by S, rounded, at least 1, as `mori replay "
                "--token-scale` sends them"),
    Option("engine_slowdown", float, _SIM.engine_slowdown, metavar="T",
           old=("time_scale",),  # the former spelling (flag and config key), still read
           help="every engine duration (steps, KV reloads) is multiplied by T, as when a "
                "trace is replayed with `mori replay --time-scale T` against a real engine"),
    Option("reload_gbps", float, _SIM.reload_gbps, metavar="GB/S",
           help="KV reload bandwidth from the CPU tier, GB/s per GPU: the simulated "
                "host-to-GPU link, which the policies also estimate with (default: the "
                "preset's, see `mori presets`; 0: no usable link, no CPU tier is "
                "simulated)"),
    Option("calibration", Path, None, metavar="FILE",
           help="engine constants measured on the machine modelled (the JSON file "
                "`python bench/calibrate_cpu_engine.py --json FILE` writes, or a "
                "benchmark's results holding one), applied to every preset of the run "
                "(default: the presets' own)"),
    Option("max_output_tokens", int, _SIM.max_output_tokens, metavar="TOKENS",
           help="cut every step's output at this many tokens (after --token-scale), as a "
                "model that ends its answers early (default: the trace's lengths)"),
    Option("tick", float, _POLICY.tick_s, metavar="S", field="tick_s",
           help="period of the policy's control loop, seconds"),
    Option("idleness_window", int, _POLICY.idleness_window, metavar="K",
           old=("window",),
           help="idleness window: the number of recent cycles a program's idleness ranks by"),
    *(o for o in _VARIANT_KNOBS if o.key != "reload_gbps"),  # the simulated link's
    Option("jobs", int, 1, metavar="N",
           help="runs in parallel processes (0: one per CPU); results keep the grid order "
                "either way"),
    Option("quiet", bool, False, help="no progress bar or notes on stderr (default: off)"),
)
"""Every option of ``mori simulate`` except ``--config``, in help order."""

BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}

SERVE_OPTIONS: tuple[Option, ...] = (
    Option("backend", str, None, repeat=True, field="backends", metavar="KIND=URL[,k=v...]",
           help="an engine replica (repeatable; see below; default: --replicas simulated "
                "engines)"),
    Option("host", str, _SERVE.host, metavar="ADDR", help="address to listen on"),
    Option("port", int, _SERVE.port, metavar="N",
           help="port to listen on; 0 picks a free one"),
    Option("replicas", int, _SERVE.replicas, metavar="N",
           help="simulated engine replicas to start when no --backend is given"),
    Option("workers", int, _SERVE.workers, metavar="N",
           help="gateway processes: 1 serves everything; N > 1 runs N-1 workers: the "
                "policy process keeps the first two open connections, hands the others to "
                "the workers, which ask it for admission"),
    Option("preset", str, _SERVE.preset, metavar="PRESET",
           help="hardware preset of the simulated engines (see `mori presets`)"),
    Option("cpu_ratio", float, _SERVE.cpu_ratio, metavar="R",
           help="CPU KV tier of the simulated engines, x the GPU pool, for policies whose "
                "engine has one"),
    Option("gpu_kv_tokens", int, _SERVE.gpu_kv_tokens, metavar="TOKENS",
           help="shrink the simulated engines' GPU KV pool to this many tokens (default: the "
                "preset's)"),
    Option("engine_script", Path, None, metavar="FILE",
           help="the simulated engines answer with this script's text and tool calls (see "
                "`mori engine-sim --help`; e.g. examples/agent-script.json), so real agents "
                "run real tools"),
    Option("policy", str, _GATEWAY.policy, metavar="NAME",
           help="scheduling policy (see `mori policies`)"),
    Option("tick", float, _POLICY.tick_s, metavar="S", field="tick_s",
           help="policy tick in seconds of policy time"),
    Option("idleness_window", int, _POLICY.idleness_window, metavar="K",
           help="idleness window: the number of recent cycles a program's idleness ranks by"),
    Option("binary_threshold", float, _POLICY.binary_threshold, metavar="X",
           help="idleness threshold of mori-binary"),
    *_VARIANT_KNOBS,
    Option("disk_read_gbps", float, _POLICY.disk_read_gbps, metavar="GB/S",
           help="the engines' KV read bandwidth from their disk tier (the vLLM plug-in's "
                "--disk-gib), GB/s, as mori prices a move to disk with (default: one "
                f"data-centre NVMe drive's, {DEFAULT_DISK_READ_GBPS:g})"),
    Option("time_scale", float, _GATEWAY.time_scale, metavar="X",
           help="policy and simulated-engine seconds per wall second (> 1 runs traces "
                "faster than real time)"),
    Option("max_held", int, _GATEWAY.max_held, metavar="N", old=("max_gated",),
           help="requests that may be held at once, waiting for GPU residency; more get 429"),
    Option("hold_timeout", float, _GATEWAY.hold_timeout_s, metavar="S", field="hold_timeout_s",
           old=("gate_timeout",),
           help="seconds a request may be held, waiting for GPU residency, before a 503 with "
                "Retry-After"),
    Option("stream_write_timeout", float, _GATEWAY.stream_write_timeout_s, metavar="S",
           field="stream_write_timeout_s",
           help="seconds a streamed answer may wait for a client that stopped reading "
                "before the stream is cut off and the engine's request aborted"),
    Option("stream_idle_timeout", float, _GATEWAY.stream_idle_timeout_s, metavar="S",
           field="stream_idle_timeout_s",
           help="seconds a streamed answer may go without a byte from its engine (before "
                "its first byte: --first-byte-timeout); beyond, the stream ends with an "
                "error event (504 if nothing was passed on yet), the step ends and the "
                "replica is probed"),
    Option("max_sse_line_bytes", int, _GATEWAY.max_sse_line_bytes, metavar="N",
           help="longest line an engine's stream may send (at least 1024); beyond, the "
                "engine's request is aborted and the client gets an error event (502 if "
                "nothing was passed on yet)"),
    Option("max_response_bytes", int, _GATEWAY.max_response_bytes, metavar="N",
           help="largest answer an engine may send whole (not streamed; also what a "
                "control-plane call to it may read), at least 65536; beyond, the engine's "
                "request is aborted (its connection dropped) and the client gets a 502"),
    Option("retry_after", float, _GATEWAY.retry_after_s, metavar="S", field="retry_after_s",
           help="Retry-After seconds on 429/503"),
    Option("program_idle_timeout", float, _GATEWAY.program_ttl_s, metavar="S",
           field="program_ttl_s",
           help="release a program (an agent's session context) that sends nothing for this "
                "many wall seconds, its KV labelled inactive; 0 never"),
    Option("abandoned_grace", float, _GATEWAY.abandoned_grace_s, metavar="S",
           field="abandoned_grace_s",
           help="release a context of an agent session left behind when a newer context of "
                "the session began (a compaction, a /clear) this many wall seconds later, "
                "unless a request of its own comes first; 0 leaves it to "
                "--program-idle-timeout"),
    Option("program_id_from", str, ",".join(_GATEWAY.program_id_from), multi=True,
           metavar="LIST",
           help="the recognisers that name a request's program, in the order tried: "
                "program-id (body program_id, X-Program-Id), claude-code (its session "
                "header or metadata.user_id), codex (its session-id / thread-id and "
                "window headers), prompt-cache-key (the body's prompt_cache_key), "
                "metadata-user (metadata.user_id from other Anthropic clients), "
                "session-header (X-Session-Id), conversation (the conversation itself: "
                "a request extending a program's last prompt and answer continues it); "
                "a request none names is anonymous"),
    Option("model_alias", str, None, repeat=True, field="model_aliases",
           metavar="PATTERN=SERVED",
           help="serve model names matching PATTERN (shell-style, e.g. 'claude-*') with the "
                "served model SERVED (repeatable; the first match wins)"),
    Option("record", str, None, metavar="FILE.jsonl.gz",
           help="append every program's steps to this trace file (MORI's trace format; "
                "`mori trace stats` and `mori simulate --traces` read it); no prompt text "
                "unless --record-text"),
    Option("record_text", bool, _GATEWAY.record_text,
           help="keep each step's new prompt text in the --record file (default: off)"),
    Option("record_text_max_bytes", int, _GATEWAY.record_text_max_bytes, metavar="N",
           help="with --record-text: keep at most N bytes (UTF-8) of one program's prompt "
                "text; text past it is cut and replaced by the marker '"
                "[... cut: over --record-text-max-bytes]' (default 1 MiB)"),
    Option("state", str, None, metavar="FILE.json",
           help="keep the programs' idleness histories in this file across a restart: "
                "written atomically every --state-interval and at shutdown, read at "
                "start (a torn or foreign file is ignored with a warning); programs the "
                "engines still hold keep their rank"),
    Option("state_interval", float, _GATEWAY.state_interval_s, metavar="S",
           field="state_interval_s", help="seconds between --state snapshots"),
    Option("max_body_bytes", int, _GATEWAY.max_body_bytes, metavar="N",
           help="largest request body accepted, on every route; larger gets 413 before it is "
                "read (a Content-Length over it at once, a chunked body when it passes it)"),
    Option("max_header_bytes", int, _GATEWAY.max_header_bytes, metavar="N",
           help="largest request head (request line and headers) accepted; larger gets 431 "
                "and the connection is closed"),
    Option("header_timeout", float, _GATEWAY.header_timeout_s, metavar="S",
           field="header_timeout_s",
           help="seconds a request head may take to arrive (from its first byte, or from "
                "the connection's opening); beyond, 408 and the connection is closed"),
    Option("keep_alive_timeout", float, _GATEWAY.keep_alive_timeout_s, metavar="S",
           field="keep_alive_timeout_s",
           help="seconds an idle keep-alive connection stays open"),
    Option("body_timeout", float, _GATEWAY.body_timeout_s, metavar="S",
           field="body_timeout_s",
           help="seconds a request body may pause between two pieces; beyond, 408 and the "
                "connection is closed"),
    Option("max_connections", int, _GATEWAY.max_connections, metavar="N",
           help="open connections per gateway process (lowered to what the descriptor limit "
                "allows); at the cap the longest-idle one is closed to make room, or, none "
                "idle, the new one gets 503"),
    Option("max_program_id_bytes", int, _GATEWAY.max_program_id_bytes, metavar="N",
           help="longest program id accepted, in bytes of UTF-8 (1 to 1024); longer gets 400"),
    Option("health_interval", float, _GATEWAY.health_interval_s, metavar="S",
           field="health_interval_s",
           help="seconds between health probes of every replica's engine"),
    Option("health_timeout", float, _GATEWAY.health_timeout_s, metavar="S",
           field="health_timeout_s",
           help="a health probe's deadline: an engine that does not answer within it "
                "missed the probe"),
    Option("health_failures", int, _GATEWAY.health_failures, metavar="N",
           help="probes a healthy replica may miss in a row before it is marked "
                "unhealthy: its programs move to the other replicas (their KV recomputed "
                "there) and its requests in flight end with 503; it rejoins when it "
                "answers again"),
    Option("max_programs_per_key", int, _GATEWAY.max_programs_per_key, metavar="N",
           help="the most live programs one API key (without keys: all clients) may hold; "
                "a request starting another gets 429 with Retry-After; 0: no limit"),
    Option("first_byte_timeout", float, _GATEWAY.first_byte_timeout_s, metavar="S",
           field="first_byte_timeout_s",
           help="seconds a forwarded request may wait for its answer to begin (a request "
                "that is not streamed: the whole answer); beyond, 504 and the replica is "
                "probed at once"),
    Option("spread_by_load", bool, _POLICY.spread_by_load,
           help="mori and its variants: spread admitted programs (while memory does not "
                "bind) onto the replica whose engine serves the fewest requests of other "
                "clients (its reported load beyond the gateway's own requests), then the "
                "most room (default: off, the most room)"),
    Option("load_interval", float, _GATEWAY.load_interval_s, metavar="S",
           field="load_interval_s",
           help="seconds between readings of the engines' load (requests running and "
                "waiting, from the /metrics of vLLM, SGLang and the simulated engine; "
                "shown in /healthz and /metrics, used by --spread-by-load); 0: never"),
    Option("startup_wait", float, _GATEWAY.startup_wait_s, metavar="S", field="startup_wait_s",
           help="seconds to wait for engines that are still starting before giving up"),
    Option("log_level", str, _SERVE.log_level, metavar="LEVEL",
           choices=("debug", "info", "warning", "error"), help="debug, info, warning or error"),
    Option("exact_tokens", bool, _GATEWAY.exact_tokens,
           help="count prompt tokens with the engine's tokenizer where it offers one (one "
                "more round trip per request) instead of estimating them from the text, "
                "scaled by what the engine counted for earlier requests (default: off)"),
    Option("learn_costs", bool, _GATEWAY.learn_costs,
           help="price each replica's recomputes and reloads by what its engine was "
                "measured to charge (from requests that ran alone: first byte against "
                "tokens computed and reloaded; shown in /v1/replicas) once 16 requests "
                "were timed; --recompute-tok-s and --reload-gbps stay the prior "
                "(default: on)"),
    Option("api_key", str, None, repeat=True, field="api_keys", metavar="KEY",
           help="require 'Authorization: Bearer KEY' on the OpenAI endpoints; each key has "
                "its own program namespace (repeatable; also --api-key-file and the "
                "environment variable MORI_API_KEYS, keys separated by commas or spaces)"),
    Option("api_key_file", Path, None, metavar="FILE",
           help="read API keys from FILE, one a line (# comments)"),
    Option("admin_key", str, None, repeat=True, field="admin_keys", metavar="KEY",
           help="a key for the inspection and control endpoints over all programs "
                "(/v1/programs, /v1/decisions, /v1/residency, release, /metrics) "
                "(repeatable; also --admin-key-file and MORI_ADMIN_KEYS)"),
    Option("admin_key_file", Path, None, metavar="FILE",
           help="read admin keys from FILE, one a line (# comments)"),
    Option("public_metrics", bool, _GATEWAY.public_metrics,
           help="serve /metrics without an admin key when keys are set (default: off)"),
    Option("allow_unauthenticated", bool, _SERVE.allow_unauthenticated,
           help="listen on a non-loopback address without any key (default: refused)"),
    Option("label_secret_file", Path, None, metavar="FILE",
           help="the secret file of the engines' MORI label channels (the file given to "
                "mori vllm-args / sglang-args --label-secret-file): every label message "
                "is signed with it; the default for each backend with labels= and no "
                "label_secret_file= of its own (also $MORI_LABEL_SECRET_FILE)"),
    Option("cors_origin", str, None, repeat=True, field="cors_origins", metavar="ORIGIN",
           help="let web pages of ORIGIN (e.g. http://localhost:3000; * for any) call the "
                "gateway from a browser: CORS preflights answered, Access-Control-Allow-"
                "Origin sent (repeatable; default: CORS off, and without keys a request "
                "from a non-loopback origin is refused with 403)"),
    Option("allowed_host", str, None, repeat=True, field="allowed_hosts", metavar="NAME",
           help="without keys, also answer requests whose Host is NAME (the gateway behind "
                "a name; repeatable; default: only loopback names and its own address, "
                "others get 403, a guard against DNS rebinding)"),
)
"""Every option of ``mori serve`` except ``--config``, in help order; defaults from
``ServeConfig``, ``GatewaySettings`` and (the policy knobs) ``PolicyConfig``."""

SERVE_BY_KEY: dict[str, Option] = {o.key: o for o in SERVE_OPTIONS}


def policy_config(values: Mapping[str, Any], by_key: Mapping[str, Option],
                  base: PolicyConfig = _POLICY) -> PolicyConfig:
    """``base`` with the policy knobs among ``values`` (option key -> value) set; values of
    other options are ignored. :class:`PolicyConfig` checks each knob; a bad one raises
    :class:`OptionError` naming its flag."""
    knobs: dict[str, Any] = {}
    for key, value in values.items():
        opt = by_key[key]
        if opt.target not in POLICY_FIELDS:
            continue
        try:
            dataclasses.replace(base, **{opt.target: value})
        except ValueError as e:
            raise OptionError(f"{opt.flag}: {e}") from None
        knobs[opt.target] = value
    return dataclasses.replace(base, **knobs)


def help_text(opt: Option) -> str:
    """The help line of ``opt``, with its default appended when it has one to show (and
    its help does not already say it)."""
    if "(default" in opt.help:
        return opt.help
    return opt.help + _default_text(opt)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option],
                help_of: Callable[[Option], str] | None = None) -> None:
    """Declare ``options`` on ``parser``: booleans as ``--x/--no-x``, ``repeat`` options
    collected in a list, the rest parsed by ``Option.parse_text``; every default is None,
    so a config file can fill the gaps."""
    for opt in options:
        text = (help_of or help_text)(opt)
        if opt.kind is bool:
            parser.add_argument(opt.flag, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        elif opt.repeat:
            parser.add_argument(opt.flag, action="append", type=_arg_type(opt), default=None,
                                metavar=opt.metavar, help=text)
        else:
            parser.add_argument(opt.flag, type=_arg_type(opt), default=None,
                                metavar=opt.metavar, help=text)
        for flag in opt.old_flags:  # former spellings: taken, with a warning, not listed
            parser.add_argument(flag, dest=opt.key, type=_arg_type(opt), default=None,
                                action=_Deprecated, new=opt.flag, help=argparse.SUPPRESS)


def deprecation(old: str, new: str) -> str:
    """The warning for a former spelling of an option."""
    return f"mori: {old} is deprecated and will be removed; use {new}"


class _Deprecated(argparse.Action):
    """Stores the value like the option's own flag, and warns on stderr."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(deprecation(option_string or self.option_strings[0], self.new),
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def _arg_type(opt: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return opt.parse_text(text)
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = opt.key  # argparse names the type in some messages
    return parse
