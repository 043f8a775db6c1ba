"""A new program's admission as programs pile up: latency of its first request on an
empty gateway, and once N programs are held, with the GPU tier full.

Starts ``mori serve`` (simulated engines in this process, a small GPU pool so a few
programs fill it, a large ``--time-scale`` so the engines answer at once) and, in the
same run, for each N of ``--held`` (ascending):

- brings the programs held to N: new program ids, one short request each, then left
  idle (Acting, in a tool call that never ends: parked on the CPU tier or on no tier;
  the gateway's idle timeout is off);
- times ``--samples`` new programs, one after the other: the wall time of each one's
  first request (sent, answered in full), then releases it
  (``POST /v1/programs/ID/release``, untimed), so every sample finds N programs held.

Reports p50 / p90 per N, and p50 against the empty gateway's (N = 0) in the same run.
The issue's target: p50 at 12,500 held within 3x the empty gateway's.

    python bench/admission_scaling.py [--held 0,1000,5000,12500] [--samples 200]
                                      [--time-scale 1000] [--gpu-kv-tokens 8000]
                                      [--py-spy FILE.txt]

``--py-spy FILE.txt`` records the gateway with py-spy while the samples at the largest
N are taken, and prints its top functions (inclusive and self share of the samples).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import pct, raise_nofile

PROMPT = "x" * 4000  # about 1,000 tokens at the gateway's 4 characters a token

def start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """``py-spy record`` of the gateway into ``out`` (collapsed stacks), until SIGINT."""
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "250",
                            "--nonblocking", "--format", "raw", "-o", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # attached
    return spy


def print_profile(path: Path, top: int) -> None:
    """The functions of a collapsed-stack file by the share of samples they were on the
    stack in (inclusive), and by the share they were on top of it (self)."""
    incl: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0] + ")"
                  for f in stack.split(";")]
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    print(f"\n{total} samples; inclusive share, self share, function")
    for f, n in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{100 * n / total:6.1f}% {100 * own.get(f, 0) / total:6.1f}%  {f}")


def start(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    serve = ["serve", "--port", "0", "--time-scale", str(args.time_scale),
             "--gpu-kv-tokens", str(args.gpu_kv_tokens), "--cpu-ratio", str(args.cpu_ratio),
             "--program-idle-timeout", str(args.idle_timeout),
             "--max-held", "100000", "--max-connections", "4096",
             "--log-level", "warning"]
    cmd = [sys.executable, "-m", "mori", *serve]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise SystemExit("mori serve exited before it listened")
    return proc, line.split("listening on ")[1].split()[0]


async def served_model(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(f"{url}/v1/models") as r:
        return str((await r.json())["data"][0]["id"])


async def one_request(s: aiohttp.ClientSession, url: str, model: str, pid: str) -> None:
    body = {"model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": PROMPT}]}
    async with s.post(f"{url}/v1/chat/completions", json=body,
                      headers={"X-Program-Id": pid}) as r:
        await r.read()
        if r.status != 200:
            raise SystemExit(f"{pid}: HTTP {r.status}: {await r.text()}")


async def fill(s: aiohttp.ClientSession, url: str, model: str, start_at: int, upto: int,
               concurrency: int) -> None:
    """Programs ``start_at`` .. ``upto`` - 1: one request each, left idle."""
    ids = iter(range(start_at, upto))

    async def worker() -> None:
        for i in ids:
            await one_request(s, url, model, f"held-{i}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def sample(s: aiohttp.ClientSession, url: str, model: str, n: int, tag: str
                 ) -> list[float]:
    """``n`` new programs one after the other: each one's first request's wall time (ms),
    the program released after it."""
    out = []
    for i in range(n):
        pid = f"new-{tag}-{i}"
        t0 = time.perf_counter()
        await one_request(s, url, model, pid)
        out.append((time.perf_counter() - t0) * 1e3)
        async with s.post(f"{url}/v1/programs/{pid}/release") as r:
            await r.read()
    return sorted(out)


async def run(args: argparse.Namespace) -> None:
    sizes = sorted(int(x) for x in args.held.split(","))
    proc, url = start(args)
    rows: list[tuple[int, float, float]] = []
    try:
        conn = aiohttp.TCPConnector(limit=args.concurrency + 8)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            model = await served_model(s, url)
            held = 0
            await sample(s, url, model, 5, "warm")
            for n in sizes:
                t0 = time.perf_counter()
                await fill(s, url, model, held, n, args.concurrency)
                filled_s = time.perf_counter() - t0
                held = max(held, n)
                await asyncio.sleep(args.settle)
                spy = (start_py_spy(proc.pid, args.py_spy)
                       if args.py_spy is not None and n == sizes[-1] else None)
                lat = await sample(s, url, model, args.samples, str(n))
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(30)
                rows.append((n, pct(lat, 50), pct(lat, 90)))
                print(f"held {n:>6}: new-program p50 {pct(lat, 50):7.2f} ms  "
                      f"p90 {pct(lat, 90):7.2f} ms  mean {statistics.fmean(lat):7.2f} ms"
                      f"  (filled in {filled_s:.1f} s)", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    base = rows[0][1]
    print(f"\n{'held':>7} {'p50 ms':>8} {'p90 ms':>8} {'p50 / N=' + str(rows[0][0]):>12}")
    for n, p50, p90 in rows:
        print(f"{n:>7} {p50:8.2f} {p90:8.2f} {p50 / base:12.2f}")
    if args.py_spy is not None:
        print_profile(args.py_spy, 30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--held", default="0,1000,5000,12500",
                    help="programs held at each measurement, ascending (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=200,
                    help="new programs timed at each size (default: %(default)s)")
    ap.add_argument("--time-scale", type=float, default=1000.0,
                    help="mori serve --time-scale (default: %(default)s)")
    ap.add_argument("--gpu-kv-tokens", type=int, default=8000,
                    help="mori serve --gpu-kv-tokens: a few programs fill it "
                    "(default: %(default)s)")
    ap.add_argument("--cpu-ratio", type=float, default=1.0,
                    help="mori serve --cpu-ratio: the CPU tier, x the GPU pool "
                    "(default: %(default)s)")
    ap.add_argument("--idle-timeout", type=float, default=3600.0,
                    help="mori serve --program-idle-timeout: longer than the run, so no "
                    "program expires (default: %(default)s, mori serve's)")
    ap.add_argument("--concurrency", type=int, default=32,
                    help="requests at once while filling (default: %(default)s)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds to wait after filling, before sampling (default: %(default)s)")
    ap.add_argument("--py-spy", type=Path, default=None, metavar="FILE.txt",
                    help="record the gateway with py-spy (pip install py-spy) while the "
                    "largest size is sampled, into this file (collapsed stacks), and "
                    "print its top functions")
    args = ap.parse_args()
    raise_nofile()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
