"""``mori serve`` as a child process: wait until it says where it listens."""

from __future__ import annotations

import subprocess
import time


def wait_listening(proc: subprocess.Popen[str], limit_s: float = 60.0) -> str:
    """Read ``proc``'s stdout until its "listening on URL" line; the URL."""
    assert proc.stdout is not None
    t0 = time.monotonic()
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "mori serve exited"
        assert time.monotonic() - t0 < limit_s, "mori serve did not start"
    return line.split("listening on ")[1].split()[0]
