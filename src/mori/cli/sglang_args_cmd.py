"""``mori sglang-args``: print the SGLang flags that run an engine the way MORI drives it."""

from __future__ import annotations

import argparse
import math
import sys
from importlib import metadata
from typing import TypeVar

from mori.cli.vllm_args_cmd import (
    DEFAULT_KV_EVENTS_ENDPOINT,
    KV_EVENTS_TOPIC,
    VLLMArgsError,
    _compact,
    _number,
    _word,
    label_warnings,
)
from mori.plugin_channel.auth import HOW_TO_MAKE, SECRET_FILE_ENV
from mori.plugin_channel.protocol import DEFAULT_LABEL_ENDPOINT
from mori.sglang_plugin.order import ROUTING_HEADER

P = TypeVar("P", bound=argparse.ArgumentParser)

BACKEND = "mori"  # the radix-cache backend mori.sglang_plugin.backend registers
TESTED_SGLANG = "0.5.23"  # the release the plug-in's tests run on (tests/sglang_inside)
LABEL_ENV = "MORI_LABEL_ENDPOINT"
WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
DEFAULT_HICACHE_RATIO = 2.0
DEFAULT_WRITE_POLICY = "write_back"

EPILOG = f"""\
what it prints:
  --radix-cache-backend {BACKEND}        (--no-plugin: --radix-eviction-policy priority)
  --enable-priority-scheduling --enable-metrics
  --kv-events-config {{"enable_kv_cache_events":true,"publisher":"zmq",
                      "endpoint":ADDR,"topic":"{KV_EVENTS_TOPIC}"}}
  --enable-hierarchical-cache --hicache-ratio R --hicache-write-policy P   (with --hicache)

  The plug-in is SGLang's own radix cache (UnifiedRadixCache, on SGLang's Python tree
  core) whose nodes remember the programs that used them (the gateway names a request's
  program in the {ROUTING_HEADER} header). It evicts on the GPU unowned pages first,
  then the inactive programs', the idle, the busy; on HiCache's host tier unowned,
  inactive, busy, then idle (least recently used first within each; with no labels,
  SGLang's own LRU). It takes the labels over ZMQ at its label endpoint, which it binds.

  mori must be installed in SGLang's environment (pip install /path/to/mori there):
  SGLang finds the plug-in through mori's entry point (group sglang.srt.plugins) before
  it parses its flags, and PYTHONPATH alone exposes no entry point. The plug-in is
  tested on SGLang {TESTED_SGLANG}'s classes with CPU tensors, not in a running server;
  sglang-args warns when another SGLang is installed beside mori. With tensor
  parallelism above 1 the plug-in does not start its label channel and eviction stays
  SGLang's LRU.

  SGLang takes no flag for the label endpoint: the plug-in binds ${LABEL_ENV}
  (default {DEFAULT_LABEL_ENDPOINT}). --label-endpoint ADDR only checks ADDR and, when
  it is not the default, says on stderr to set {LABEL_ENV}=ADDR in SGLang's
  environment. The gateway connects to it:
    mori serve --backend sglang=URL,labels={DEFAULT_LABEL_ENDPOINT}

  The label channel's secret is no flag either: the plug-in reads ${SECRET_FILE_ENV}
  (every label message must be signed with it: an HMAC-SHA256; {HOW_TO_MAKE}).
  --label-secret-file FILE says on stderr to set {SECRET_FILE_ENV}=FILE; the gateway
  is given the same file (labels=ADDR,label_secret_file=FILE, or mori serve
  --label-secret-file FILE). An endpoint off loopback needs it: the plug-in refuses to
  start without it, and sglang-args warns.

  --hicache adds HiCache, a host KV tier of R x the GPU pool (R > 1). With write_back
  (the default) pages move to the host when the GPU evicts them, in MORI's order, and
  come back on a prefix hit; write_through copies a page to the host as it enters the
  tree (write_through_selective: once it is hit again).
  --no-plugin prints plain SGLang as MORI's adapter drives it: priority scheduling and
  SGLang's priority eviction, no labels.

using the output:
  The flags are printed on one line, separated by single spaces. No flag or value holds
  a space, a single quote or a backslash, and none is shell-quoted: the line is meant to
  be split on spaces and nothing else, and the double quotes of the JSON value are part
  of the word. In bash, `$(...)` unquoted does exactly that:

    {LABEL_ENV}=tcp://127.0.0.1:5558 python -m sglang.launch_server \\
        --model-path MODEL $(mori sglang-args --hicache)

  Off loopback, with the secret:

    {LABEL_ENV}=tcp://10.0.0.5:5558 {SECRET_FILE_ENV}=/etc/mori/label.key \\
        python -m sglang.launch_server --model-path MODEL $(mori sglang-args)

  A KV-events endpoint that binds every interface holds `*` ("tcp://*:5557"); bash
  leaves a pattern that matches no file as it is, unless `nullglob` or `failglob` is
  set. To avoid globbing altogether: read -r -a FLAGS <<< "$(mori sglang-args ...)";
  python -m sglang.launch_server --model-path MODEL "${{FLAGS[@]}}".
  In zsh, write ${{=$(mori sglang-args ...)}}.

examples:
  mori sglang-args --hicache
  mori sglang-args --hicache --hicache-ratio 4 --hicache-write-policy write_through
  mori sglang-args --label-endpoint tcp://127.0.0.1:6558 --kv-events-endpoint 'tcp://*:6557'
  mori sglang-args --no-plugin
"""


class SGLangArgsError(ValueError):
    """Options that cannot be turned into SGLang flags (the text says why)."""


def _ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(v) or v <= 1:
        raise argparse.ArgumentTypeError(
            f"must be above 1 (the host pool is larger than the GPU pool), got {text}")
    return v


def add_sglang_args_parser(sub: argparse._SubParsersAction[P]) -> P:
    """Add the ``sglang-args`` subcommand to ``sub``; returns its parser."""
    p = sub.add_parser(
        "sglang-args",
        help="print the SGLang flags for an engine MORI drives (with the plug-in)",
        description="Print the flags `python -m sglang.launch_server` needs to run an "
        "engine the way MORI drives it: MORI's radix-cache backend, priority scheduling, "
        "metrics, KV-cache events, and optionally HiCache's host tier. Use: "
        f"{LABEL_ENV}=ADDR python -m sglang.launch_server --model-path MODEL "
        "$(mori sglang-args ...)",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label-endpoint", default=DEFAULT_LABEL_ENDPOINT, metavar="ADDR",
                   help="ZMQ endpoint the plug-in binds for the gateway's labels; SGLang "
                        f"takes no flag for it: set {LABEL_ENV}=ADDR in SGLang's "
                        f"environment (default: {DEFAULT_LABEL_ENDPOINT}; one per engine)")
    p.add_argument("--label-secret-file", metavar="FILE",
                   help="the label channel's secret (the same file goes to the gateway); "
                        f"SGLang takes no flag for it: set {SECRET_FILE_ENV}=FILE in "
                        "SGLang's environment; needed for a label endpoint off loopback")
    p.add_argument("--kv-events-endpoint", default=DEFAULT_KV_EVENTS_ENDPOINT, metavar="ADDR",
                   help="ZMQ endpoint SGLang publishes KV events on (default: "
                        f"{DEFAULT_KV_EVENTS_ENDPOINT}; `*` binds, see below)")
    p.add_argument("--hicache", action="store_true",
                   help="add HiCache, SGLang's host KV tier (evicted in MORI's order with "
                        "the plug-in)")
    p.add_argument("--hicache-ratio", type=_ratio, metavar="R",
                   help="host pool as a multiple of the GPU pool, above 1 (default: "
                        f"{_number(DEFAULT_HICACHE_RATIO)}; needs --hicache)")
    p.add_argument("--hicache-write-policy", choices=WRITE_POLICIES, metavar="P",
                   help=f"{', '.join(WRITE_POLICIES)} (default: {DEFAULT_WRITE_POLICY}: "
                        "pages move to the host as the GPU evicts them; needs --hicache)")
    p.add_argument("--no-plugin", action="store_true",
                   help="leave out --radix-cache-backend and use SGLang's "
                        "--radix-eviction-policy priority (plain SGLang)")
    return p


def sglang_flags(*, kv_events_endpoint: str = DEFAULT_KV_EVENTS_ENDPOINT,
                 hicache: bool = False, hicache_ratio: float | None = None,
                 hicache_write_policy: str | None = None,
                 plugin: bool = True) -> list[str]:
    """The SGLang flags, one list item per word (see the command's help). The label
    endpoint is no flag: SGLang reads it from ``$MORI_LABEL_ENDPOINT``."""
    if not hicache and (hicache_ratio is not None or hicache_write_policy is not None):
        raise SGLangArgsError("--hicache-ratio and --hicache-write-policy need --hicache")
    flags = (["--radix-cache-backend", BACKEND] if plugin
             else ["--radix-eviction-policy", "priority"])
    flags += ["--enable-priority-scheduling", "--enable-metrics"]
    flags += ["--kv-events-config", _compact({
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": _word("--kv-events-endpoint", kv_events_endpoint),
        "topic": KV_EVENTS_TOPIC})]
    if hicache:
        ratio = DEFAULT_HICACHE_RATIO if hicache_ratio is None else hicache_ratio
        if not math.isfinite(ratio) or ratio <= 1:
            raise SGLangArgsError(f"--hicache-ratio must be above 1, got {ratio}")
        policy = hicache_write_policy or DEFAULT_WRITE_POLICY
        if policy not in WRITE_POLICIES:
            raise SGLangArgsError(f"--hicache-write-policy is one of "
                                  f"{', '.join(WRITE_POLICIES)}, got {policy!r}")
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", _number(ratio),
                  "--hicache-write-policy", policy]
    return flags


def label_endpoint_note(label_endpoint: str, *, plugin: bool) -> str | None:
    """The line telling to set ``$MORI_LABEL_ENDPOINT`` (SGLang has no flag for it), or
    ``None`` when the plug-in would bind the default anyway."""
    if not plugin or label_endpoint == DEFAULT_LABEL_ENDPOINT:
        return None
    return (f"SGLang takes no flag for the label endpoint: set {LABEL_ENV}={label_endpoint} "
            f"in SGLang's environment ({LABEL_ENV}={label_endpoint} python -m "
            "sglang.launch_server ...); the gateway's labels= option names the same endpoint")


def secret_note(secret_file: str) -> str:
    """The line telling to set ``$MORI_LABEL_SECRET_FILE`` (SGLang has no flag for it)."""
    return (f"SGLang takes no flag for the label secret: set {SECRET_FILE_ENV}={secret_file} "
            f"in SGLang's environment; the gateway's label_secret_file= option (or mori "
            "serve --label-secret-file) names the same file")


def installed_sglang() -> str | None:
    """The SGLang release installed beside mori (without importing it), or ``None``."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def release_warning(version: str | None, *, plugin: bool) -> str | None:
    """A warning when the SGLang installed beside mori is not the release the plug-in is
    tested on; ``None`` otherwise, and when no SGLang is installed here (the engine may
    run in another environment)."""
    if version is None or not plugin or version == TESTED_SGLANG:
        return None
    return (f"SGLang {version} is installed here; the plug-in is tested on SGLang "
            f"{TESTED_SGLANG} only (it subclasses SGLang's radix cache and tree core, "
            "internals that change between releases): if the engine fails to start or "
            "the plug-in does not load, use --no-plugin")


def run_sglang_args(args: argparse.Namespace) -> int:
    plugin = not args.no_plugin
    try:
        flags = sglang_flags(kv_events_endpoint=args.kv_events_endpoint,
                             hicache=args.hicache, hicache_ratio=args.hicache_ratio,
                             hicache_write_policy=args.hicache_write_policy, plugin=plugin)
        if plugin:
            _word("--label-endpoint", args.label_endpoint)
            if args.label_secret_file is not None:
                _word("--label-secret-file", args.label_secret_file)
    except (SGLangArgsError, VLLMArgsError) as e:
        print(f"mori sglang-args: error: {e}", file=sys.stderr)
        return 2
    note = label_endpoint_note(args.label_endpoint, plugin=plugin)
    if note:
        print(f"mori sglang-args: note: {note}", file=sys.stderr)
    if plugin and args.label_secret_file is not None:
        print(f"mori sglang-args: note: {secret_note(args.label_secret_file)}",
              file=sys.stderr)
    for line in label_warnings(args.label_endpoint, args.label_secret_file,
                               plugin=plugin, engine="SGLang"):
        print(f"mori sglang-args: warning: {line}", file=sys.stderr)
    warning = release_warning(installed_sglang(), plugin=plugin)
    if warning:
        print(f"mori sglang-args: warning: {warning}", file=sys.stderr)
    print(" ".join(flags))
    return 0
