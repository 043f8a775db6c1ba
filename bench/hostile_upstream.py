"""What a hostile engine costs the gateway: one huge SSE line, and a stream that stalls.

A scripted engine (this script with ``--engine PORT``: a bare asyncio HTTP/1.1 server)
answers each streamed chat completion by its model name:

- ``line-N``: one SSE event whose single line is N MiB (a text delta), sent in 64 KiB
  writes, then ``[DONE]``;
- ``events-N``: the same N MiB as 4 KiB events (the baseline: a normal stream of the
  same size);
- ``stall``: one event, then nothing (the connection held open).

``mori serve`` runs in front of it (``--max-sse-line-bytes`` raised above the largest
line so the lines pass whole; a second gateway with the default cap shows the refusal),
and for each stream the script reports the gateway's CPU time (``/proc``) and the
latency of ``/healthz``, polled every 10 ms by a separate process while the stream is
read: the max and p99 (target: max within 100 ms for a 40 MiB line). CPU per MiB staying
flat from 10 to 40 MiB shows parsing linear in the bytes (it was quadratic: 0.5 / 1.6 /
9.7 / 54.2 s for 10 / 20 / 40 / 80 MiB). The stall is run with ``--stream-idle-timeout
S``: the time until the client's stream ends (target: at most S + 5 s).

``--baseline-src DIR`` runs the same lines through a gateway from another checkout's
``src`` (e.g. ``git worktree add /tmp/before REV``), for a before/after in one run.

    python bench/hostile_upstream.py [--sizes 10,20,40] [--idle 2] [--baseline-src DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import cpu_seconds, free_port, pct

PIECE = 64 * 1024


# -- the engine -----------------------------------------------------------------------------

def _chunk(content: str) -> bytes:
    return b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "m",
                                   "choices": [{"index": 0, "delta": {"content": content},
                                                "finish_reason": None}]}).encode() + b"\n\n"


async def _stream(model: str, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"connection: close\r\n\r\n")
    kind, _, size = model.partition("-")
    total = int(size or 0) * 1024 * 1024
    if kind == "line":
        head = b'data: {"id": "x", "object": "chat.completion.chunk", "choices": ' \
               b'[{"index": 0, "delta": {"content": "'
        writer.write(head)
        piece = b"a" * PIECE
        for _ in range(total // PIECE):
            writer.write(piece)
            await writer.drain()
        writer.write(b'"}, "finish_reason": null}]}\n\n')
    elif kind == "events":
        batch = _chunk("a" * 4000) * 16
        for _ in range(total // len(batch)):
            writer.write(batch)
            await writer.drain()
    else:  # stall
        writer.write(_chunk("w "))
        await writer.drain()
        await reader.read()
        return
    writer.write(b"data: [DONE]\n\n")
    await writer.drain()


_MODELS = json.dumps({"object": "list", "data": [
    {"id": m, "object": "model"} for m in
    ["stall", *(f"{k}-{n}" for k in ("line", "events") for n in range(1, 257))]]}).encode()
"""Every script is a served model (the gateway checks the names)."""


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            m = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
            body = await reader.readexactly(int(m.group(1)) if m else 0)
            if head.startswith(b"GET"):
                data = _MODELS
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
                continue
            await _stream(str(json.loads(body)["model"]), reader, writer)
            break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def run_engine(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


# -- the /healthz poller (its own process: the client's reading does not delay it) ------------

def run_poller(url: str) -> None:
    """Poll ``url`` every 10 ms until standard input closes; print the latencies (ms)."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    out: list[float] = []
    with httpx.Client(timeout=30) as c:
        c.get(url)
        print("ready", flush=True)
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get(url)
            out.append((time.perf_counter() - t0) * 1000)
            stop.wait(0.01)
    print(json.dumps(out))


class Poller:
    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--poll", url + "/healthz"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # "ready": polling before the stream starts
        time.sleep(0.1)

    def stop(self) -> list[float]:
        out, _ = self.proc.communicate("", timeout=60)
        return [float(x) for x in json.loads(out)]


# -- the gateway ------------------------------------------------------------------------------

class Gateway:
    def __init__(self, engine: str, flags: list[str], src: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = src
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mori", "serve", "--port", str(self.port), "--backend",
             f"openai={engine},kv_tokens=1000000", "--log-level", "warning", *flags],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("mori serve did not start")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(gw: Gateway, model: str) -> dict[str, Any]:
    """Stream one answer of ``model`` through ``gw``: the gateway's CPU seconds, the
    stream's wall time, bytes, status, and ``/healthz`` latencies meanwhile."""
    poller = Poller(gw.url)
    cpu0 = cpu_seconds(gw.proc.pid) or 0.0
    t0 = time.perf_counter()
    got = 0
    tail = b""
    with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=600, json={
            "model": model, "stream": True, "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}]}) as r:
        for data in r.iter_raw(1 << 20):
            got += len(data)
            tail = (tail + data)[-300:]
        status = r.status_code
    wall = time.perf_counter() - t0
    cpu = (cpu_seconds(gw.proc.pid) or 0.0) - cpu0
    lat = poller.stop()
    return {"model": model, "status": status, "bytes": got, "wall_s": round(wall, 3),
            "gateway_cpu_s": round(cpu, 3), "healthz_max_ms": round(max(lat), 1),
            "healthz_p99_ms": round(pct(lat, 99), 1), "healthz_polls": len(lat),
            "ended_with": tail[-120:].decode("latin-1").strip()[-120:]}


def show(label: str, row: dict[str, Any]) -> None:
    mib = row["bytes"] / 2**20
    print(f"{label:<10} {row['model']:<10} status {row['status']}  {mib:7.1f} MiB  "
          f"wall {row['wall_s']:7.2f} s  gateway CPU {row['gateway_cpu_s']:6.2f} s  "
          f"/healthz max {row['healthz_max_ms']:7.1f} ms  p99 {row['healthz_p99_ms']:6.1f} ms"
          f"  ({row['healthz_polls']} polls)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,20,40", help="line sizes in MiB")
    ap.add_argument("--idle", type=float, default=2.0, help="--stream-idle-timeout for the "
                    "stall")
    ap.add_argument("--baseline-src", default=None, help="another checkout's src folder")
    ap.add_argument("--baseline-sizes", default="10,20", help="line sizes for the baseline")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--engine", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--poll", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        asyncio.run(run_engine(a.engine))
        return
    if a.poll:
        run_poller(a.poll)
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    port = free_port()
    engine = subprocess.Popen([sys.executable, __file__, "--engine", str(port)])
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(1.0)
        cap = str((max(sizes) + 8) * 2**20)
        gw = Gateway(url, ["--max-sse-line-bytes", cap, "--stream-idle-timeout",
                           str(a.idle)])
        try:
            measure(gw, "events-1")  # warm
            for n in sizes:
                for model in (f"events-{n}", f"line-{n}"):
                    row = measure(gw, model)
                    show("mori", row)
                    rows.append({"gateway": "mori", **row})
            t0 = time.perf_counter()
            with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=600, json={
                    "model": "stall", "stream": True, "max_tokens": 5,
                    "messages": [{"role": "user", "content": "hi"}]}) as r:
                text = r.read().decode()
            took = time.perf_counter() - t0
            ok = "sent nothing mid-stream" in text
            print(f"stall      --stream-idle-timeout {a.idle:g}: the client's stream ended "
                  f"after {took:.2f} s (target <= {a.idle + 5:g} s), with the error event: "
                  f"{ok}", flush=True)
            rows.append({"gateway": "mori", "model": "stall", "idle_s": a.idle,
                         "ended_after_s": round(took, 3), "error_event": ok})
        finally:
            gw.stop()
        gw = Gateway(url, [])  # the default cap (8 MiB)
        try:
            row = measure(gw, f"line-{max(sizes)}")
            show("mori cap", row)
            rows.append({"gateway": "mori, default cap", **row})
        finally:
            gw.stop()
        if a.baseline_src:
            gw = Gateway(url, [], src=a.baseline_src)
            try:
                for n in [int(s) for s in a.baseline_sizes.split(",")]:
                    for model in (f"events-{n}", f"line-{n}"):
                        row = measure(gw, model)
                        show("before", row)
                        rows.append({"gateway": "before", **row})
            finally:
                gw.stop()
    finally:
        engine.terminate()
        engine.wait(10)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
