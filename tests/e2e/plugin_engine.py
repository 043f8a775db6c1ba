"""Fresh vLLM CPU engines for the plug-in's end-to-end tests, and the calls they make.

:func:`start_engine` starts ``scripts/start_vllm_cpu.sh`` on free ports, with or without
MORI's plug-in and with or without a CPU KV tier, and waits for ``/health``; the caller
stops it (``conftest.stop_group``). The helpers talk to it over HTTP and, for labels,
over the plug-in's ZMQ channel.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from .conftest import (
    BLOCK_SIZE,
    CPU_BUILD,
    SCRIPTS,
    START_TIMEOUT_S,
    _build_model,
    _install_venv,
    free_port,
    http_ok,
    release_env,
    stop_group,
)

T = TypeVar("T")

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "zeta",
         "lambda", "tau", "rho", "phi", "chi", "psi", "eta", "iota", "nu", "xi", "mu")


@dataclass(frozen=True)
class Engine:
    url: str
    labels: str | None  # the label endpoint, with the plug-in
    log: Path
    kv_events: str


def start_engine(tmp: Path, *, plugin: bool, num_blocks: int, cpu_gib: float | None = None,
                 name: str | None = None, release: str = CPU_BUILD,
                 disk: tuple[float, Path] | None = None, label_secret: Path | None = None
                 ) -> tuple[Engine, subprocess.Popen[bytes]]:
    """A fresh engine of ``num_blocks`` KV blocks (``cpu_gib``: with a host tier; ``disk``:
    GiB and directory of a disk tier behind it; ``label_secret``: the label channel's
    secret file, ``mori vllm-args --label-secret-file``), running vLLM ``release``
    (``conftest.ENGINE_RELEASES``)."""
    venv = _install_venv()
    model = _build_model(venv)
    name = name or ("vllm-plugin" if plugin else "vllm-plain")
    env = {**os.environ, "MORI_VLLM_VENV": str(venv), "MORI_PYTHON": sys.executable,
           "MORI_VLLM_PLUGIN": "1" if plugin else "0", **release_env(release)}
    if cpu_gib is not None:
        env["MORI_VLLM_CPU_GIB"] = repr(cpu_gib)
    if disk is not None:
        env["MORI_VLLM_DISK_GIB"], env["MORI_VLLM_DISK_DIR"] = repr(disk[0]), str(disk[1])
    if label_secret is not None:
        env["MORI_VLLM_LABEL_SECRET_FILE"] = str(label_secret)
    failures: list[str] = []
    for attempt in range(START_ATTEMPTS):
        log = tmp / (f"{name}.log" if attempt == 0 else f"{name}.retry{attempt}.log")
        started = _start_once(model, env, log, plugin, num_blocks)
        if isinstance(started, tuple):
            return started
        failures.append(f"--- attempt {attempt + 1} ({log}):\n{started}")
        if "timed out" in started:
            break  # a slow machine will not start faster a second time
    pytest.fail(f"vLLM ({name}) did not start:\n" + "\n".join(failures), pytrace=False)


# An engine that dies while starting is started once more on fresh ports: a port that
# ``free_port`` found free can be taken by another process before vLLM binds it.
START_ATTEMPTS = 2


def _start_once(model: Path, env: dict[str, str], log: Path, plugin: bool,
                num_blocks: int) -> tuple[Engine, subprocess.Popen[bytes]] | str:
    """One try at starting the engine: the engine and its process, or why it did not
    start (the log's first error and its last lines)."""
    port, kv_port, label_port = free_port(), free_port(), free_port()
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["bash", str(SCRIPTS / "start_vllm_cpu.sh"), str(model), str(port), str(kv_port),
             str(num_blocks), str(label_port)],
            stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while not http_ok(url + "/health"):
        timed_out = time.monotonic() - t0 > START_TIMEOUT_S
        if proc.poll() is not None or timed_out:
            stop_group(proc)
            text = log.read_text(errors="replace")
            why = f"timed out after {START_TIMEOUT_S} s" if timed_out else (
                f"exited {proc.returncode}")
            return f"{why}; first error:\n{first_error(text)}\n... last lines:\n{text[-1500:]}"
        time.sleep(1.0)
    return Engine(url, f"tcp://127.0.0.1:{label_port}" if plugin else None, log,
                  f"tcp://127.0.0.1:{kv_port}"), proc


def first_error(log: str, around: int = 2500) -> str:
    """The part of an engine's log from its first traceback or ERROR line: the root cause,
    which the end of the log (the parent's own traceback) does not show."""
    marks = [i for i in (log.find("Traceback"), log.find(" ERROR ")) if i >= 0]
    if not marks:
        return "(no traceback or ERROR line)"
    start = log.rfind("\n", 0, min(marks)) + 1
    return log[start:start + around]


def with_and_without_plugin(tmp: Path, scenario: Callable[[Engine], T], *, num_blocks: int,
                            cpu_gib: float | None = None, name: str = "vllm",
                            release: str = CPU_BUILD) -> dict[str, T]:
    """``scenario`` on a fresh engine with the plug-in, then on one without (both running
    vLLM ``release``); the outcomes by ``plugin`` / ``plain``. Each engine's log must hold
    no traceback, and name the release."""
    out: dict[str, T] = {}
    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    for plugin in (True, False):
        key = "plugin" if plugin else "plain"
        engine, proc = start_engine(tmp, plugin=plugin, num_blocks=num_blocks,
                                    cpu_gib=cpu_gib, name=f"{name}-{key}", release=release)
        try:
            out[key] = scenario(engine)
            log = engine.log.read_text(errors="replace")  # before the shutdown's own noise
            assert "Traceback" not in log, log[-3000:]
            assert f"LLM engine (v{release}" in log, (
                f"the engine's log does not name vLLM {release}:\n{log[-3000:]}")
        finally:
            stop_group(proc)
    return out


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def fit_prompt(url: str, seed: int, blocks: int) -> str:
    """A text whose prompt is just under ``blocks`` KV blocks."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(blocks * BLOCK_SIZE)]
    lo, hi = 1, len(words)
    while lo < hi:  # the longest prefix of the words that fits the blocks
        mid = (lo + hi + 1) // 2
        n = post(url + "/tokenize", {"model": "tiny", "prompt": " ".join(words[:mid])})["count"]
        if n <= blocks * BLOCK_SIZE - 4:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def ask(url: str, program: str, prompt: str) -> int:
    """Send ``prompt`` as ``program``; the prompt tokens found cached."""
    out = post(url + "/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        "session_id": program, "vllm_xargs": {"kv_cache_report_mode": "full"}})
    details = out["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus counter's samples on ``/metrics`` (0 when absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def label(endpoint: str, labels: dict[str, str]) -> dict[str, Any]:
    """Handshake with the plug-in, then set ``labels``; the two replies by op."""
    return ask_plugin(endpoint, [("hello", {}), ("set", {"labels": labels})])


def ask_plugin(endpoint: str, messages: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Send the plug-in each ``(op, fields)`` in turn; the replies by op."""
    import zmq

    from mori.plugin_channel import protocol

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        replies = {}
        for op, fields in messages:
            sock.send(protocol.encode(op, **fields))
            if not sock.poll(10_000):
                pytest.fail(f"the plug-in did not answer {op!r} at {endpoint}", pytrace=False)
            replies[op] = protocol.decode_reply(sock.recv())
        return replies
    finally:
        sock.close()


@dataclass(frozen=True)
class Pressured:
    """Three programs' prompts after a fourth has pushed some of their KV out."""

    prompts: dict[str, str]  # A, B, C
    prompt_tokens: dict[str, int]
    first: dict[str, int]  # cached tokens of each program's first request
    handshake: dict[str, Any] | None  # the plug-in's hello (None without the plug-in)


def three_then_pressure(engine: Engine, labels: dict[str, str], program_blocks: int,
                        pressure_blocks: int) -> Pressured:
    """Programs ``prog-A``, ``prog-B`` and ``prog-C`` each send a prompt of just under
    ``program_blocks`` blocks; on a plug-in engine they are then labelled ``labels`` (by
    letter); then ``prog-D`` sends one of ``pressure_blocks`` blocks."""
    url = engine.url
    prompts = {p: fit_prompt(url, seed, program_blocks) for seed, p in enumerate("ABC")}
    pressure = fit_prompt(url, 99, pressure_blocks)
    sizes = {p: post(url + "/tokenize", {"model": "tiny", "prompt": t})["count"]
             for p, t in prompts.items()}
    first = {p: ask(url, f"prog-{p}", prompts[p]) for p in "ABC"}
    handshake = None
    if engine.labels is not None:
        replies = label(engine.labels, {f"prog-{p}": v for p, v in labels.items()})
        handshake = replies["hello"]
        assert replies["set"]["ok"], replies
        time.sleep(0.5)  # applied at the scheduler's next step: D's request is one
    ask(url, "prog-D", pressure)
    return Pressured(prompts, sizes, first, handshake)
