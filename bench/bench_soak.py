"""Soak: many concurrent programs through ``mori serve`` for minutes; errors, latency, RSS.

Starts ``mori serve`` as a subprocess on a free port (simulated engines in-process, at
``--time-scale``; more serve flags with ``--serve-arg``, repeatable), then keeps
``--programs`` agent programs running for ``--seconds``. Each program loops: a chat
completion (a growing synthetic prompt in the ``mori`` field, ``--max-tokens`` output,
streamed for a ``--stream`` share of programs), a tool gap (exponential, mean
``--tool-time`` wall seconds), for ``--steps-per-program`` steps; then it releases itself
(except a ``--never-release-share`` of programs, which the gateway must end by its
``--program-idle-timeout``) and a new program, with a new id, takes its slot. 429 and 503 answers
that carry ``Retry-After`` are retried after that long (counted as retries, not errors).
At the end, programs still running are released (never-release ones are left), the
gateway's program list is counted, then counted again after the TTL has passed.

Reports requests sent / completed, errors by HTTP status and exceptions by type, retries,
latency p50/p90/p99/max (send to last byte, of the attempt that completed), and the serve
process's RSS over time (``/proc/PID/status`` VmRSS every ``--rss-interval`` s) with the
growth of the last third's mean over the middle third's (it levels off if that is under
``--rss-growth-limit`` %). Exits 1 if any request failed or serve died.

The defaults (first prompt 256 tokens, +32 a step, 10 steps, 3 s mean tool gaps, time
scale 20) give about 350 requests/s at 1,000 programs on a 2-core machine, below where the
gateway and its in-process simulated engine saturate one core; every context fits the
preset's GPU KV, so nothing is gated (``--prompt-tokens 1000 --growth-tokens 200``
exercises gating, at a far lower request rate).

    python bench/bench_soak.py [--programs 1000] [--seconds 300] [--steps-per-program 10]
        [--tool-time 3] [--never-release-share 0.2] [--stream 0.5] [--time-scale 20]
        [--program-ttl 30] [--serve-arg=--replicas=2 ...] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

import aiohttp
from benchutil import free_port, pct, raise_nofile, rss_mb, tail
from soak_report import Sample, Stats, metric_sum, report, serve_flag
from tqdm import tqdm

RETRY_STATUSES = (429, 503)


class Soak:
    def __init__(self, args: argparse.Namespace, base: str, model: str,
                 session: aiohttp.ClientSession) -> None:
        self.args, self.base, self.model, self.s = args, base, model, session
        self.stats = Stats()
        self.rng = random.Random(args.seed)
        self.deadline = 0.0
        self.stop = asyncio.Event()

    def tool_gap(self) -> float:
        mean = self.args.tool_time
        return min(self.rng.expovariate(1 / mean), 5 * mean) if mean > 0 else 0.0

    async def sleep_until_stop(self, seconds: float) -> bool:
        """Sleep, or less if the run ends; True if the run ended."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)
        return self.stop.is_set()

    async def one_request(self, body: dict[str, Any], stream: bool) -> bool:
        """One step's request, retried on 429/503 + Retry-After; True if it completed."""
        st = self.stats
        while True:
            st.sent += 1
            t0 = time.perf_counter()
            retry_after: float | None = None
            status = 0
            try:
                async with self.s.post(self.base + "/v1/chat/completions", json=body) as r:
                    status = r.status
                    if r.status == 200:
                        ok, why = await (self._read_stream(r) if stream else self._read_json(r))
                        if ok:
                            st.completed += 1
                            st.latencies.append(time.perf_counter() - t0)
                            return True
                        st.error("bad body" if not stream else "stream error", why)
                        return False
                    text = await r.text()
                    ra = r.headers.get("Retry-After")
                    if r.status in RETRY_STATUSES and ra is not None:
                        try:
                            retry_after = float(ra)
                        except ValueError:
                            retry_after = None
                    if retry_after is None:
                        st.error(f"http {r.status}", text)
                        return False
            except (aiohttp.ClientError, TimeoutError) as e:
                st.error(type(e).__name__, repr(e))
                return False
            st.retries[status] += 1
            if await self.sleep_until_stop(retry_after * self.rng.uniform(1.0, 1.5)):
                st.gave_up_at_end += 1
                return False

    @staticmethod
    async def _read_json(r: aiohttp.ClientResponse) -> tuple[bool, str]:
        raw = await r.read()
        try:
            data = json.loads(raw)
        except ValueError:
            return False, raw[:300].decode(errors="replace")
        if isinstance(data, dict) and data.get("choices"):
            return True, ""
        return False, raw[:300].decode(errors="replace")

    @staticmethod
    async def _read_stream(r: aiohttp.ClientResponse) -> tuple[bool, str]:
        done, chunks = False, 0
        async for line in r.content:
            s = line.strip()
            if not s.startswith(b"data:"):
                continue  # blank lines, SSE comments (": kv-ready"), event names
            payload = s[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            if payload.startswith(b'{"error"'):
                return False, payload[:300].decode(errors="replace")
            chunks += 1
        if not done:
            return False, f"stream ended without [DONE] after {chunks} chunks"
        return True, ""

    async def release(self, pid: str) -> None:
        try:
            async with self.s.post(f"{self.base}/v1/programs/{pid}/release") as r:
                await r.read()
                if r.status == 200:
                    self.stats.released += 1
                else:
                    self.stats.release_errors[f"http {r.status}"] += 1
        except (aiohttp.ClientError, TimeoutError) as e:
            self.stats.release_errors[type(e).__name__] += 1

    async def slot(self, i: int) -> None:
        a, st = self.args, self.stats
        gen = 0
        # stagger the first requests over one mean tool gap
        if await self.sleep_until_stop(self.rng.uniform(0, max(a.tool_time, 0.1))):
            return
        while not self.stop.is_set():
            pid = f"soak-{a.seed}-{i}-{gen}"
            gen += 1
            never = self.rng.random() < a.never_release_share
            stream = self.rng.random() < a.stream
            st.programs_started += 1
            prompt, reuse = a.prompt_tokens, 0
            finished = True
            for step in range(a.steps_per_program):
                if step:
                    if await self.sleep_until_stop(self.tool_gap()):
                        finished = False
                        break
                    reuse = prompt + a.max_tokens  # the last prompt + its answer, cached
                    prompt = reuse + a.growth_tokens
                body = {"model": self.model, "program_id": pid, "stream": stream,
                        "max_tokens": a.max_tokens,
                        "messages": [{"role": "user", "content": f"step {step} of {pid}"}],
                        "mori": {"prompt_tokens": prompt, "reuse_tokens": reuse}}
                await self.one_request(body, stream)
                if self.stop.is_set():
                    finished = step == a.steps_per_program - 1
                    break
            if finished:
                st.programs_finished += 1
            else:
                st.cut_at_end += 1
            if never:
                st.never_released += 1
            else:
                await self.release(pid)  # programs cut at the end release too

    async def listed(self) -> int | None:
        try:
            async with self.s.get(self.base + "/v1/programs") as r:
                if r.status != 200:
                    return None
                return len((await r.json())["data"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return None


async def wait_up(url: str, proc: subprocess.Popen[bytes], log_path: str,
                  timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"mori serve exited ({proc.returncode}): "
                                   f"{tail(log_path, 30)}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    nofile = raise_nofile()
    serve_args: list[str] = []
    for a in args.serve_arg:
        serve_args.extend(a.split())
    ttl_s = serve_flag(serve_args, "--program-idle-timeout")
    ttl = float(ttl_s) if ttl_s is not None else args.program_ttl
    scale_s = serve_flag(serve_args, "--time-scale")
    scale = float(scale_s) if scale_s is not None else args.time_scale
    port = free_port()
    cmd = [sys.executable, "-m", "mori", "serve", "--port", str(port),
           "--time-scale", str(args.time_scale), "--program-idle-timeout", str(args.program_ttl),
           "--log-level", args.log_level, *serve_args]
    log_path = args.serve_log or tempfile.mkstemp(prefix="mori-soak-", suffix=".log")[1]
    log_f: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    print(f"serve: {' '.join(cmd[1:])} (pid {proc.pid}, log {log_path}, nofile {nofile})",
          file=sys.stderr, flush=True)
    samples: list[Sample] = []
    result: dict[str, Any] = {}
    try:
        await wait_up(base + "/healthz", proc, log_path)
        conn = aiohttp.TCPConnector(limit=args.programs + 100, limit_per_host=0,
                                    force_close=False)
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            async with s.get(base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            soak = Soak(args, base, model, s)
            st = soak.stats
            t0 = time.monotonic()
            soak.deadline = t0 + args.seconds
            tasks = [asyncio.create_task(soak.slot(i)) for i in range(args.programs)]

            async def sampler() -> None:
                while True:
                    samples.append(Sample(time.monotonic() - t0, rss_mb(proc.pid),
                                          await soak.listed(), st.completed))
                    await asyncio.sleep(args.rss_interval)

            samp = asyncio.create_task(sampler())
            bar = tqdm(total=int(args.seconds), unit="s", file=sys.stderr, dynamic_ncols=True,
                       disable=args.no_progress)
            last_done, last_t = 0, t0
            while (now := time.monotonic()) < soak.deadline:
                await asyncio.sleep(min(1.0, soak.deadline - now))
                if proc.poll() is not None:
                    print(f"\nmori serve exited ({proc.returncode}) mid-run:\n"
                          f"{tail(log_path, 30)}", file=sys.stderr)
                    break
                now = time.monotonic()
                bar.n = min(int(now - t0), int(args.seconds))
                rate = (st.completed - last_done) / max(now - last_t, 1e-9)
                last_done, last_t = st.completed, now
                rss = samples[-1].rss_mb if samples else None
                bar.set_postfix(sent=st.sent, done=st.completed, rps=f"{rate:.0f}",
                                err=sum(st.errors.values()), retry=sum(st.retries.values()),
                                rss=f"{rss:.0f}M" if rss else "?", refresh=False)
                bar.refresh()
            bar.close()
            soak.stop.set()
            wall = time.monotonic() - t0
            # let in-flight requests end (and programs release) before counting
            _, pending = await asyncio.wait(tasks, timeout=args.request_timeout + 10)
            for t in pending:
                t.cancel()
            drain_s = time.monotonic() - t0 - wall
            samp.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await samp
            samples.append(Sample(time.monotonic() - t0, rss_mb(proc.pid),
                                  await soak.listed(), st.completed))
            listed_end = samples[-1].listed
            listed_after_ttl = None
            tick_wall = 5.0 / scale  # the default --tick, in wall seconds
            wait_ttl = (ttl + 2 * tick_wall + 2) if args.wait_ttl and ttl > 0 else 0.0
            if wait_ttl:
                print(f"waiting {wait_ttl:.0f} s for the program TTL ({ttl:g} s) ...",
                      file=sys.stderr, flush=True)
                await asyncio.sleep(wait_ttl)
                listed_after_ttl = await soak.listed()
            async with s.get(base + "/metrics") as r:
                metrics = await r.text()
        lat = sorted(st.latencies)
        rss_vals = [x.rss_mb for x in samples if x.rss_mb is not None]
        n = len(rss_vals)
        mid = rss_vals[n // 3: 2 * n // 3]
        last = rss_vals[2 * n // 3:]
        growth = (100 * (statistics.fmean(last) / statistics.fmean(mid) - 1)
                  if mid and last else float("nan"))
        with open(log_path, errors="replace") as f:
            log_lines = f.readlines()
        ttl_released = sum("idle for over" in ln for ln in log_lines)
        bad_lines = [ln.rstrip() for ln in log_lines
                     if any(w in ln for w in ("WARNING", "ERROR", "Traceback", "CRITICAL"))]
        result = {
            "config": dict(vars(args)),
            "serve_cmd": cmd[1:], "nofile": nofile, "wall_s": wall, "drain_s": drain_s,
            "sent": st.sent, "completed": st.completed,
            "completed_per_s": st.completed / wall if wall else float("nan"),
            "errors": dict(st.errors), "error_samples": st.error_samples,
            "errors_total": sum(st.errors.values()),
            "retries": {str(k): v for k, v in st.retries.items()},
            "gave_up_at_end": st.gave_up_at_end,
            "latency_s": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99),
                          "max": lat[-1] if lat else float("nan"),
                          "mean": statistics.fmean(lat) if lat else float("nan")},
            "programs": {"started": st.programs_started, "finished": st.programs_finished,
                         "cut_at_end": st.cut_at_end, "released": st.released,
                         "release_errors": dict(st.release_errors),
                         "never_released": st.never_released,
                         "ttl_released_log_lines": ttl_released,
                         "listed_at_end": listed_end, "listed_after_ttl": listed_after_ttl,
                         "ttl_s": ttl},
            "rss_mb": [{"t": round(x.t, 1), "rss_mb": x.rss_mb, "listed": x.listed,
                        "completed": x.completed} for x in samples],
            "rss_growth_pct": growth,
            "rss_levels_off": bool(growth < args.rss_growth_limit),
            "serve_warnings": bad_lines[:50], "serve_warning_count": len(bad_lines),
            "serve_alive": proc.poll() is None,
            "gateway_metrics": {
                name: metric_sum(metrics, name) for name in (
                    "mori_requests_total", "mori_gated_requests_total",
                    "mori_upstream_errors_total", "mori_client_disconnects_total",
                    "mori_promotions_total", "mori_demotions_total", "mori_programs")},
        }
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log_f.close()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=1000, help="concurrent programs")
    ap.add_argument("--seconds", type=float, default=300.0, help="duration (wall s)")
    ap.add_argument("--steps-per-program", type=int, default=10)
    ap.add_argument("--tool-time", type=float, default=3.0,
                    help="mean tool gap between a program's steps (wall s, exponential)")
    ap.add_argument("--never-release-share", type=float, default=0.2,
                    help="share of programs that never release (left to the TTL)")
    ap.add_argument("--stream", type=float, default=0.5, help="share of streaming programs")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="first step's prompt")
    ap.add_argument("--growth-tokens", type=int, default=32, help="new prompt tokens a step")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=20.0, help="serve's --time-scale")
    ap.add_argument("--program-ttl", type=float, default=30.0, help="serve's --program-idle-timeout")
    ap.add_argument("--log-level", default="info", help="serve's --log-level")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="more serve flags, repeatable, split on spaces "
                         "(--serve-arg='--replicas 2'); they win over the ones above")
    ap.add_argument("--serve-log", default=None, help="serve's output (default: a temp file)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--rss-interval", type=float, default=5.0)
    ap.add_argument("--rss-growth-limit", type=float, default=5.0,
                    help="RSS levels off if the last third grew less than this %% over the "
                         "middle third")
    ap.add_argument("--table-rows", type=int, default=25, help="rows of the RSS table")
    ap.add_argument("--no-wait-ttl", dest="wait_ttl", action="store_false",
                    help="do not wait for the TTL to count the programs again")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    report(res, args.table_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    ok = res["errors_total"] == 0 and res["serve_alive"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
