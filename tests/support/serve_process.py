"""``mori serve`` (or another command) as a child process: wait until it says where it
listens; stop it."""

from __future__ import annotations

import subprocess
import time
from typing import Any


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


def stop(proc: subprocess.Popen[Any]) -> None:
    """Terminate ``proc``, and kill it if it has not ended 20 s later."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
