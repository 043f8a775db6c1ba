"""Engines that die or hang, and a gateway restart, against real engine processes.

Two ``mori engine-sim`` processes behind a gateway served in this process. An engine is
killed (``SIGKILL``) or frozen (``SIGSTOP``, as a hung engine: it accepts connections
and answers nothing); the gateway's health probes find it, its programs are placed on
the other replica and served there (recomputed), requests in flight there end with 503
at once, and it rejoins when it answers again. A restarted gateway reads the engines'
residency and sends every program back to the replica holding its KV.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from mori.engines.simulated import SimEngineAdapter
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from support.loop_thread import LoopThread

pytestmark = pytest.mark.slow

PROGRAMS = [f"agent-{i}" for i in range(12)]
FAST_HEALTH = dict(health_interval_s=0.2, health_timeout_s=0.3, health_failures=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def engines(n: int = 2) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """``n`` engine-sim processes (h200-qwen3-30b-a3b at 20x time, a CPU tier, typed
    eviction); their URLs and processes."""
    out: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        for _ in range(n):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "mori", "engine-sim", "--preset", "h200-qwen3-30b-a3b",
                 "--port", str(port), "--time-scale", "20", "--cpu-ratio", "1",
                 "--typed-eviction", "--gpu-kv-tokens", "200000"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            out.append((f"http://127.0.0.1:{port}", proc))
        for url, proc in out:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None, "engine-sim exited at start"
                assert time.monotonic() < deadline, "engine-sim did not start"
                time.sleep(0.1)
        yield out
    finally:
        for _, proc in out:
            with_signal(proc, signal.SIGCONT)
            proc.kill()
            proc.wait(10)


def with_signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)


def gateway(lt: LoopThread, urls: list[str], **settings: Any) -> tuple[str, Any]:
    app = create_app(GatewaySettings(**{**FAST_HEALTH, **settings}),
                     [SimEngineAdapter(u) for u in urls])
    running = lt.serve(app)
    return running.url, running


def ask(url: str, pid: str, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=timeout, json={
        "model": "Qwen3-30B-A3B", "max_tokens": 8, "program_id": pid,
        "messages": [{"role": "user", "content": f"{pid}: " + "step " * 200}]})


def replica_of(url: str, pid: str) -> int | None:
    r = httpx.get(f"{url}/v1/programs/{pid}", timeout=10)
    assert r.status_code == 200, r.text
    rep: int | None = r.json()["replica"]
    return rep


def serve_until_ok(url: str, pid: str, within_s: float) -> httpx.Response:
    """Ask until answered 200 (a 503 with Retry-After is the clean answer while the
    gateway finds the engine gone); fails past ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        r = ask(url, pid)
        if r.status_code == 200:
            return r
        assert r.status_code == 503 and "retry-after" in r.headers, (r.status_code, r.text)
        assert r.json()["error"]["message"], r.text
        assert time.monotonic() < deadline, f"{pid} still refused after {within_s} s"
        time.sleep(0.1)


def spread(url: str) -> dict[str, int]:
    """Every program's first step; where each one is."""
    for pid in PROGRAMS:
        assert ask(url, pid).status_code == 200
    where = {pid: replica_of(url, pid) for pid in PROGRAMS}
    assert set(where.values()) == {0, 1}, where  # both replicas in use
    return {pid: r for pid, r in where.items() if r is not None}


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_killed_engine_fails_its_programs_over_to_the_other_replica(
        loop_thread: LoopThread) -> None:
    with engines() as procs:
        url, _ = gateway(loop_thread, [u for u, _ in procs])
        where = spread(url)
        with_signal(procs[1][1], signal.SIGKILL)
        t0 = time.monotonic()
        for pid in PROGRAMS:  # every program is served again, the lost ones on replica 0
            serve_until_ok(url, pid, within_s=10)
            assert replica_of(url, pid) == 0
        assert time.monotonic() - t0 < 20
        moved = sum(1 for r in where.values() if r == 1)
        assert metric(url, "mori_failover_programs_total") == moved > 0
        health = httpx.get(url + "/healthz", timeout=10).json()
        assert [r["healthy"] for r in health["replicas"]] == [True, False]


def test_a_hung_engine_is_found_its_requests_end_and_it_rejoins(
        loop_thread: LoopThread) -> None:
    with engines() as procs:
        url, _ = gateway(loop_thread, [u for u, _ in procs])
        where = spread(url)
        on_1 = next(pid for pid, r in where.items() if r == 1)
        with_signal(procs[1][1], signal.SIGSTOP)  # accepts, answers nothing
        t0 = time.monotonic()
        r = ask(url, on_1)  # forwarded to the frozen engine before the probes notice
        took = time.monotonic() - t0
        if r.status_code == 503:  # ended when the replica was given up, not at 600 s
            assert "retry-after" in r.headers and took < 10, (took, r.text)
            r = serve_until_ok(url, on_1, within_s=10)
        assert r.status_code == 200 and replica_of(url, on_1) == 0
        assert httpx.get(url + "/healthz", timeout=10).json()["replicas"][1]["healthy"] \
            is False
        with_signal(procs[1][1], signal.SIGCONT)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/healthz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the engine did not rejoin"
            time.sleep(0.1)
        # back in service: new programs are placed on it again
        fresh = [f"new-{i}" for i in range(6)]
        for pid in fresh:
            assert ask(url, pid).status_code == 200
        assert 1 in {replica_of(url, pid) for pid in fresh}


def test_a_restarted_gateway_sends_every_program_back_to_its_kv(
        loop_thread: LoopThread) -> None:
    with engines() as procs:
        urls = [u for u, _ in procs]
        url, first = gateway(loop_thread, urls)
        where = spread(url)
        released, live = PROGRAMS[:2], PROGRAMS[2:]
        for pid in released:  # ended by their clients: their KV stays, inactive
            assert httpx.post(f"{url}/v1/programs/{pid}/release").status_code == 200
        loop_thread.call(first.stop())  # the gateway goes away; the engines keep the KV
        url, _ = gateway(loop_thread, urls)
        back = {pid: replica_of(url, pid) for pid in live}
        # known again before any request, each where its KV is; the released ones not
        assert back == {pid: where[pid] for pid in live}
        for pid in released:
            assert httpx.get(f"{url}/v1/programs/{pid}").status_code == 404
        for pid in PROGRAMS:
            assert ask(url, pid).status_code == 200
            assert replica_of(url, pid) == where[pid]
        # each program's KV sits on one engine only: none was recomputed on the other
        held = [httpx.get(u + "/mori/v1/residency", timeout=10).json() for u in urls]
        for pid in PROGRAMS:
            on = [i for i, res in enumerate(held)
                  if pid in res["gpu_tokens"] or pid in res["cpu_tokens"]]
            assert on == [where[pid]], (pid, on, where[pid])
