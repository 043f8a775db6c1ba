"""``mori serve`` starting and stopping as a user sees it: a busy port is one clear error
(nothing left unclosed), and a stop prints each of uvicorn's shutdown lines once."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from mori.cli.serve_cmd import EmbeddedServerFilter
from support.serve_process import wait_listening

SHUTDOWN_LINES = ("Shutting down", "Waiting for application shutdown.",
                  "Application shutdown complete.", "Finished server process")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_a_busy_port_is_one_clear_error_and_nothing_is_left_unclosed() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "mori", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120, env=ENV, check=False)
    assert proc.returncode == 1
    assert f"mori serve: error: cannot listen on 127.0.0.1:{port}: Address already in use" \
        in proc.stderr
    assert "Unclosed" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_each_shutdown_line_is_printed_once(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--port", "0",
                             "--replicas", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        wait_listening(proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode in (0, -sig)
    for text in SHUTDOWN_LINES:
        assert err.count(text) == 1, (text, err)
    assert "Unclosed" not in err and "Traceback" not in err


def _record(level: int) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.error", level, __file__, 1, "Shutting down", None, None)


def test_the_filter_drops_only_the_embedded_servers_info_lines() -> None:
    f = EmbeddedServerFilter()
    assert f.filter(_record(logging.INFO))  # no event loop: kept

    async def check(level: int) -> bool:
        return f.filter(_record(level))

    async def logged_in(name: str, level: int) -> bool:
        return await asyncio.create_task(check(level), name=name)

    async def main() -> list[bool]:
        return [await logged_in("uvicorn:8001", logging.INFO),
                await logged_in("uvicorn:8001", logging.WARNING),
                await logged_in("Task-7", logging.INFO)]

    assert asyncio.run(main()) == [False, True, True]
