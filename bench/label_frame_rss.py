"""What one large frame on the label channel costs the engine's process: the peak
resident memory (``VmHWM``) of a process running the label server, before and after a
peer without the secret sends one frame of ``--mib`` MiB (the peak: a frame read whole
and then freed leaves the current RSS where it was).

In the same run, two servers, each in its own fresh process:

- ``unbounded``: the label server with its frame limit raised to 2 GiB (what the channel
  was before ZMQ's ``MAXMSGSIZE`` was set: ZMQ reads the whole frame into memory before
  the server sees it);
- ``default``: the label server as the plug-ins start it (``protocol.MAX_FRAME_BYTES``,
  1 MiB): ZMQ drops the connection on the frame's header.

Reports each one's peak-RSS growth and the ratio default / unbounded; the issue's bound is a
growth under 20 MB for a 100 MiB frame. No engine is needed (the real-vLLM check is
``tests/e2e/test_vllm_plugin_label_auth.py``).

    python bench/label_frame_rss.py [--mib 100]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import zmq

CHILD = r"""
import sys, time
from mori.plugin_channel.auth import LabelSecret
from mori.plugin_channel.server import LabelServer
limit = int(sys.argv[2])
s = LabelServer(sys.argv[1], dict, secret=LabelSecret([b"k" * 64]), max_frame_bytes=limit)
assert s.start()
print("ready", flush=True)
sys.stdin.readline()
s.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float:
    """The process's peak resident memory so far."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def growth(limit: int, frame_bytes: int) -> float:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (os.path.join(os.path.dirname(__file__), "..", "src"),
                    os.environ.get("PYTHONPATH", "")) if p)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, endpoint, str(limit)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(0.5)
        before = rss_mb(child.pid)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        sock.send(b"{" * frame_bytes)
        sock.poll(3000)  # the unbounded one answers with a refusal; the default drops us
        time.sleep(1.0)
        after = rss_mb(child.pid)
        ctx.destroy(0)
        child.stdin.write(b"\n")
        child.stdin.flush()
        child.wait(10)
        return after - before
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=100, help="the frame's size in MiB")
    args = ap.parse_args()
    from mori.plugin_channel.protocol import MAX_FRAME_BYTES

    frame = args.mib << 20
    unbounded = growth(2**31 - 1, frame)
    default = growth(MAX_FRAME_BYTES, frame)
    print(f"a {args.mib} MiB frame from a peer without the secret:")
    print(f"  unbounded (MAXMSGSIZE 2 GiB): peak RSS +{unbounded:.1f} MB")
    print(f"  default   (MAXMSGSIZE {MAX_FRAME_BYTES >> 20} MiB): peak RSS +{default:.1f} MB")
    print(f"  ratio default / unbounded: {default / unbounded:.3f}" if unbounded > 0
          else "  (the unbounded server did not grow: nothing to compare)")


if __name__ == "__main__":
    main()
