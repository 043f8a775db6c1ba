"""The dashboard with many programs: how fast the page loads and the state is built.

Starts ``mori serve`` (simulated replicas, an admin key), registers ``--programs``
programs (one short request each through the official ``openai`` client; they stay,
acting), then:

- times ``GET /dashboard/state`` against ``GET /v1/programs`` (the plain JSON listing of
  the same programs) in the same run: median wall time and bytes of each, and the ratio;
- loads ``/dashboard`` ``--loads`` times in headless Chromium (Debian's, via Playwright):
  milliseconds from navigation start to the first full render of every program
  (``performance.now()`` when the page drew its first state).

    python bench/bench_dashboard.py [--programs 1000] [--loads 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import raise_nofile

ADMIN = "sk-bench-admin"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def start_serve(replicas: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mori", "serve", "--port", "0", "--replicas", str(replicas),
         "--time-scale", "50", "--admin-key", ADMIN, "--api-key", ADMIN,
         "--log-level", "warning", "--max-held", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = ""
    while "listening on" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise SystemExit("mori serve exited")
    return proc, line.split("listening on ")[1].split()[0]


async def register(url: str, n: int) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=ADMIN, max_retries=5,
                                timeout=300)
    model = (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with sem:
            await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"step of program {i}"}],
                max_tokens=2, extra_body={"program_id": f"bench-program-{i:05d}"})

    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()


def timed_get(url: str, path: str, rounds: int) -> tuple[float, int]:
    """Median seconds and the body size of ``rounds`` GETs of ``path``."""
    times, size = [], 0
    with httpx.Client(headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60) as c:
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = c.get(url + path)
            times.append(time.perf_counter() - t0)
            r.raise_for_status()
            size = len(r.content)
    return statistics.median(times), size


def page_loads(url: str, chromium: str, loads: int, n: int) -> list[float]:
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=ARGS)
        for _ in range(loads):
            ctx = browser.new_context(viewport={"width": 1280, "height": 1000})
            page: Any = ctx.new_page()
            page.goto(f"{url}/dashboard#key={ADMIN}")
            page.wait_for_function("() => document.body.dataset.firstRenderMs !== undefined",
                                   timeout=30_000)
            shown = page.evaluate("() => document.querySelectorAll('#programs tbody tr').length")
            assert shown >= n, f"the page shows {shown} programs, expected {n}"
            out.append(float(page.evaluate("() => +document.body.dataset.firstRenderMs")))
            ctx.close()
        browser.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=1000)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--loads", type=int, default=5, help="page loads in the browser")
    ap.add_argument("--rounds", type=int, default=20, help="GETs of each endpoint")
    ap.add_argument("--chromium", default=os.environ.get("MORI_CHROMIUM", "/usr/bin/chromium"))
    a = ap.parse_args()
    raise_nofile()
    proc, url = start_serve(a.replicas)
    try:
        t0 = time.perf_counter()
        asyncio.run(register(url, a.programs))
        print(f"registered {a.programs} programs in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
        state_s, state_b = timed_get(url, "/dashboard/state", a.rounds)
        list_s, list_b = timed_get(url, "/v1/programs", a.rounds)
        loads = page_loads(url, a.chromium, a.loads, a.programs)
    finally:
        proc.terminate()
        proc.wait(20)
    print(f"programs: {a.programs} on {a.replicas} replicas")
    print(f"GET /dashboard/state: {state_s * 1e3:.1f} ms median, {state_b / 1024:.0f} KiB")
    print(f"GET /v1/programs:     {list_s * 1e3:.1f} ms median, {list_b / 1024:.0f} KiB")
    print(f"state / programs listing: {state_s / list_s:.2f}x the time")
    print(f"page load to first full render (ms): median {statistics.median(loads):.0f}, "
          f"max {max(loads):.0f} over {len(loads)} loads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
