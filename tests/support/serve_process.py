"""``mori serve`` (or another command) as a child process: wait until it says where it
listens; stop it. ``serve`` starts ``mori serve`` with simulated engines on a free port,
its log collected line by line (for the tests that talk to it over raw sockets)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
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


@dataclass
class Serve:
    """A ``mori serve`` process; ``log`` collects its standard error, line by line."""

    proc: subprocess.Popen[str]
    url: str
    host: str
    port: int
    log: list[str] = field(default_factory=list)

    def logged(self, text: str, within: float = 10.0) -> bool:
        """Whether a line with ``text`` is in the log (waiting up to ``within`` s: it is
        read by a thread)."""
        deadline = time.monotonic() + within
        while not any(text in line for line in list(self.log)):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def serve(*args: str, nofile: int | None = None) -> Serve:
    """``mori serve`` on a free port with simulated engines (``nofile``: its descriptor
    limit, soft and hard, so that it cannot raise it)."""
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--port", "0",
                             "--log-level", "warning", "--time-scale", "50", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=limit)
    try:
        url = wait_listening(proc)
    except BaseException:
        stop(proc)
        raise
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = Serve(proc, url, host, int(port))

    def drain(stream: Any, into: list[str] | None) -> None:
        for line in stream:
            if into is not None:
                into.append(line)

    assert proc.stderr is not None and proc.stdout is not None
    threading.Thread(target=drain, args=(proc.stderr, s.log), daemon=True).start()
    threading.Thread(target=drain, args=(proc.stdout, None), daemon=True).start()
    return s
