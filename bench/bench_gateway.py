"""Gateway overhead: latency added and throughput, against the same simulated engine.

Starts one simulated engine (``mori engine-sim`` at a huge time scale, so the model's
own time is negligible and what is measured is HTTP + scheduling work) and ``mori
serve`` in front of it, each in its own process, then drives both from this process with
aiohttp: at each concurrency, ``C`` closed-loop workers send streaming chat completions
(8 tokens each) for ``--seconds``, first straight to the engine, then through the
gateway (each worker is one program). Reports per-request latency p50/p99 (send to last
byte) and requests/s for both, and the gateway's added latency (p50 and p99 difference)
and throughput ratio, measured in the same run since these machines are shared and noisy.
Client, gateway and engine share this machine's cores.

    python bench/bench_gateway.py [--concurrency 1,50,200] [--seconds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp

PRESET = "h200-qwen3-30b-a3b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"{url} exited: {err[-2000:]}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def load(url: str, model: str, concurrency: int, seconds: float) -> dict[str, Any]:
    lat: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker(i: int) -> None:
            nonlocal errors
            body = {"model": model, "stream": True, "max_tokens": 8, "program_id": f"w{i}",
                    "messages": [{"role": "user", "content": "hello there"}]}
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        async for _ in r.content.iter_any():
                            pass
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"requests": len(lat), "errors": errors, "rps": len(lat) / wall,
            "p50_ms": 1e3 * pct(lat, 50), "p99_ms": 1e3 * pct(lat, 99),
            "mean_ms": 1e3 * statistics.fmean(lat) if lat else float("nan")}


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    eport, gport = free_port(), free_port()
    engine = start([sys.executable, "-m", "mori", "engine-sim", "--preset", PRESET,
                    "--port", str(eport), "--time-scale", "1e6"])
    gateway = start([*args.gateway_prefix.split(), sys.executable, "-m", "mori", "serve", "--backend",
                     f"sim=http://127.0.0.1:{eport}", "--port", str(gport),
                     "--log-level", "warning"])
    direct, via = f"http://127.0.0.1:{eport}", f"http://127.0.0.1:{gport}"
    rows = []
    try:
        await wait_up(direct + "/health", engine)
        await wait_up(via + "/healthz", gateway)
        async with aiohttp.ClientSession() as s, s.get(direct + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        await load(via, model, 4, 1.0)  # warm up both
        for c in args.concurrency:
            d = await load(direct, model, c, args.seconds)
            g = await load(via, model, c, args.seconds)
            rows.append({"concurrency": c, "direct": d, "gateway": g,
                         "added_p50_ms": g["p50_ms"] - d["p50_ms"],
                         "added_p99_ms": g["p99_ms"] - d["p99_ms"],
                         "throughput_ratio": g["rps"] / d["rps"] if d["rps"] else float("nan")})
            print(f"c={c:<4d} direct p50 {d['p50_ms']:7.2f} ms p99 {d['p99_ms']:7.2f} ms "
                  f"{d['rps']:7.1f} req/s | gateway p50 {g['p50_ms']:7.2f} ms p99 "
                  f"{g['p99_ms']:7.2f} ms {g['rps']:7.1f} req/s | added p50 "
                  f"{rows[-1]['added_p50_ms']:+.2f} ms p99 {rows[-1]['added_p99_ms']:+.2f} ms, "
                  f"throughput x{rows[-1]['throughput_ratio']:.2f}"
                  + (f", errors {d['errors']}/{g['errors']}" if d["errors"] or g["errors"] else ""),
                  flush=True)
    finally:
        for p in (gateway, engine):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,50,200",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gateway-prefix", default="", help="a command to run the gateway under "
                    "(e.g. a profiler: 'py-spy record -o gw.svg --')")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
