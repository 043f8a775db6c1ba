"""A Dynamo fleet on loopback: the frontend, mocker workers and a router, as processes.

Shared by the end-to-end tests (tests/e2e/test_dynamo_router.py) and the benchmark
(bench/bench_dynamo.py). Everything runs with the Python of the venv
``scripts/dynamo_cpu_env.sh`` makes, with no etcd or NATS (file discovery under the
fleet's folder, the TCP request plane, ZMQ events) and every socket on 127.0.0.1. The
checkout's ``src/`` is on ``PYTHONPATH``, so ``python -m mori dynamo-router`` runs this
checkout's router.

Routers (``ROUTERS``): ``mori`` (``mori dynamo-router``), ``thunderagent`` (Dynamo's
``dynamo.thunderagent_router``), both registered as the public model in front of workers
registered under ``BACKEND_MODEL``; ``kv`` (Dynamo's KV router inside the frontend: the
workers register as the public model themselves).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BACKEND_MODEL = "mocker-backend"
ROUTERS = ("mori", "thunderagent", "kv")


class FleetError(RuntimeError):
    """The fleet did not start; the message has the failing process's log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """Each mocker worker: GPU and host KV blocks (0: no host tier), block size, time
    compression."""

    gpu_blocks: int = 64
    host_blocks: int = 256
    block_size: int = 16
    speedup: float = 10.0


@dataclass
class DynamoFleet:
    """One fleet's processes (by name), their logs, and the frontend's URL."""

    venv: Path
    tokenizer: Path
    folder: Path
    model: str = "agent"
    router: str = "mori"
    shape: WorkerShape = field(default_factory=WorkerShape)
    router_args: tuple[str, ...] = ()
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        (self.folder / "discovery").mkdir(parents=True, exist_ok=True)
        return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self.folder / "discovery"),
                "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
                "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
                "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
                "PYTHONPATH": str(ROOT / "src")}

    def start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(self.folder / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([str(self.venv / "bin" / "python"), *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env(),
                                    start_new_session=True, cwd=self.folder)
        self.procs[name] = proc
        return proc

    def start_worker(self, name: str) -> None:
        s = self.shape
        served = self.model if self.router == "kv" else BACKEND_MODEL
        self.start(name, ["-m", "dynamo.mocker", "--model-path", str(self.tokenizer),
                          "--model-name", served, "--num-gpu-blocks-override",
                          str(s.gpu_blocks), "--block-size", str(s.block_size),
                          *(["--num-host-blocks", str(s.host_blocks)] if s.host_blocks else []),
                          "--speedup-ratio", str(s.speedup)])  # the mocker takes no 0 host

    def start_fleet(self, workers: int = 2, timeout_s: float = 120.0) -> float:
        """Start the frontend, ``workers`` workers and the router; wait until the public
        model is served. Returns the seconds it took. Raises ``FleetError``."""
        t0 = time.monotonic()
        mode = "kv" if self.router == "kv" else "round-robin"
        self.start("frontend", ["-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                "--http-port", str(self.port), "--router-mode", mode])
        names = [f"worker-{chr(ord('a') + i)}" for i in range(workers)]
        for name in names:
            self.start_worker(name)
        s = self.shape
        if self.router == "mori":
            self.start("router", ["-m", "mori", "dynamo-router", "--model-name", self.model,
                                  "--model-path", str(self.tokenizer), "--workers",
                                  str(workers), "--block-size", str(s.block_size),
                                  *(["--host-tokens", str(s.host_blocks * s.block_size)]
                                    if s.host_blocks else []),
                                  *self.router_args])
        elif self.router == "thunderagent":
            self.start("router", ["-m", "dynamo.thunderagent_router", "--endpoint",
                                  "dynamo.backend.generate", "--model-name", self.model,
                                  "--model-path", str(self.tokenizer),
                                  "--router-block-size", str(s.block_size),
                                  *self.router_args])
        elif self.router != "kv":
            raise FleetError(f"unknown router {self.router!r}; one of {', '.join(ROUTERS)}")
        deadline = time.monotonic() + timeout_s
        while not self.serving(len(names)):
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise FleetError(f"{name} exited with {proc.returncode} while starting:\n"
                                     f"{self.tail(name)}")
            if time.monotonic() > deadline:
                raise FleetError(f"the fleet did not serve {self.model!r} within "
                                 f"{timeout_s:.0f} s:\n{self.tail(next(reversed(self.procs)))}")
            time.sleep(0.5)
        return time.monotonic() - t0

    def serving(self, workers: int) -> bool:
        """Whether the frontend lists the public model (and, for ``kv``, sees every
        worker's registration)."""
        status, body = http_json(self.url + "/v1/models", timeout=5)
        if status != 200 or not isinstance(body, dict):
            return False
        if self.model not in {m.get("id") for m in body.get("data", [])}:
            return False
        return self.router != "kv" or all(self.worker_id(f"worker-{chr(ord('a') + i)}", 0)
                                          is not None for i in range(workers))

    def worker_id(self, name: str, timeout_s: float = 60.0) -> int | None:
        """The Dynamo instance id worker ``name`` registered (from its log; None if it has
        not within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = re.search(r"WorkerKvQuery endpoint starting for worker (\d+)", self.log(name))
            if m:
                return int(m.group(1))
            if time.monotonic() >= deadline or self.procs[name].poll() is not None:
                return None
            time.sleep(0.2)

    def log(self, name: str) -> str:
        try:
            return (self.folder / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, name: str, n: int = 30) -> str:
        return "\n".join(self.log(name).splitlines()[-n:])

    def kill(self, name: str) -> None:
        """Kill one process (and what it spawned) at once, as a crash would."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.procs.clear()


# one token each in the tiny tokenizer (scripts/make_tiny_model.py: its training text)
COMMON = ("the", "agent", "reads", "a", "file", "then", "runs", "the", "tests", "and", "edits",
          "the", "code", "until", "the", "build", "passes")


def words(n: int, seed: str) -> str:
    """About ``n`` tokens of text in the tiny tokenizer, distinct per ``seed`` from its
    first block on (prefix caching hashes each block with the ones before it)."""
    return f"{seed} " + " ".join(COMMON[i % len(COMMON)] for i in range(n))


def http_json(url: str, body: dict[str, Any] | None = None,
              headers: dict[str, str] | None = None, timeout: float = 60.0
              ) -> tuple[int, Any]:
    """POST ``body`` (GET without one); the status and the parsed answer (0, None: no
    answer)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json",
                                             **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read().decode(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    except OSError:
        return 0, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw
