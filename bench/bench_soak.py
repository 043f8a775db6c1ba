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
preset's GPU KV, so nothing is held (``--prompt-tokens 1000 --growth-tokens 200``
exercises holding, at a far lower request rate).

    python bench/bench_soak.py [--programs 1000] [--seconds 300] [--steps-per-program 10]
        [--tool-time 3] [--never-release-share 0.2] [--stream 0.5] [--time-scale 20]
        [--program-ttl 30] [--serve-arg=--replicas=2 ...] [--seed 0] [--json out.json]

Fault injection (``--engines N``): N ``mori engine-sim`` processes (free ports; the preset,
time scale, CPU ratio and typed eviction the in-process engines would have) are started
and given to ``mori serve`` as ``--backend sim=URL``, with faster health checks
(``--health-interval 0.5 --health-timeout 1``, overridable with ``--serve-arg``). Then
``--kill-engine-at S`` SIGKILLs engine ``--kill-engine`` (default 1, the gateway's replica
1) and starts it again on its port (empty) ``--engine-down-s`` later; the programs it held
are read from ``/v1/programs`` first, and the time from the kill to each one's first 200
is measured, with the time until the gateway marked the replica unhealthy and healthy
again (``/healthz``) and ``mori_failover_programs_total``. ``--restart-gateway-at S``
reads every program's replica, stops ``mori serve`` (SIGTERM, wait), starts it again on
the same port with the same flags, reads the engines' residency and the programs again
(before the clients held by the restart are let through) and counts the programs whose KV an engine still
holds that came back at the same replica (kept), at another replica that holds their KV,
or elsewhere / not at all (placement lost). Clients ride through the restart: connection
failures from SIGTERM until ``--restart-grace`` s after the new gateway answers are
retried once it is back (counted apart, not as errors).

Every answer that is not a 200 ending well is classified: clean (a 5xx or 429 with
``Retry-After``, retried after that long; a stream ended by an error event, retried after
``--stream-retry-s``) or unclean (a status without ``Retry-After``, a stream cut without an
error event, a bad body, a connection failure outside the restart window, a timeout: the
step is given up). The run exits 1 on any unclean answer, any placement lost, or a dead
``mori serve``; without faults also on any step given up (as before).

    python bench/bench_soak.py --programs 1000 --seconds 300 --engines 2 \\
        --kill-engine-at 60 --engine-down-s 30 --restart-gateway-at 180
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from tqdm import tqdm

from bench.benchutil import free_port, pct, raise_nofile, rss_mb, tail
from bench.soak_faults import (
    FAULT_SERVE_DEFAULTS,
    Child,
    Faults,
    engine_cmds,
    list_programs,
    note,
    wait_up,
)
from bench.soak_report import Sample, Stats, metric_sum, report, serve_flag


class Soak:
    def __init__(self, args: argparse.Namespace, base: str, model: str,
                 session: aiohttp.ClientSession) -> None:
        self.args, self.base, self.model, self.s = args, base, model, session
        self.stats = Stats()
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.deadline = 0.0
        self.stop = asyncio.Event()
        # the gateway's restart: down from SIGTERM until the new one answers
        self.gw_up = asyncio.Event()
        self.gw_up.set()
        self.gw_down = False
        self.gw_up_at = -math.inf
        # the engine kill: the programs the killed replica held, each one's first 200
        self.kill_t: float | None = None
        self.on_killed: set[str] = set()
        self.first_ok: dict[str, float] = {}
        self.released_ids: set[str] = set()  # programs this client released

    def rt(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.t0

    def tool_gap(self) -> float:
        mean = self.args.tool_time
        return min(self.rng.expovariate(1 / mean), 5 * mean) if mean > 0 else 0.0

    async def sleep_until_stop(self, seconds: float) -> bool:
        """Sleep, or less if the run ends; True if the run ended."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)
        return self.stop.is_set()

    def in_restart(self) -> bool:
        """Whether the gateway is restarting (or came back under ``--restart-grace`` ago)."""
        return self.gw_down or time.monotonic() - self.gw_up_at < self.args.restart_grace

    async def wait_gateway(self) -> bool:
        """Wait until the restarted gateway is back, then a short jitter; True if the run
        ended first."""
        if not self.gw_up.is_set():
            up = asyncio.ensure_future(self.gw_up.wait())
            end = asyncio.ensure_future(self.stop.wait())
            await asyncio.wait({up, end}, return_when=asyncio.FIRST_COMPLETED)
            for t in (up, end):
                t.cancel()
        return await self.sleep_until_stop(self.rng.uniform(0.0, 0.5))

    def note_ok(self, pid: str, started: float) -> None:
        if (self.kill_t is not None and started >= self.kill_t and pid in self.on_killed
                and pid not in self.first_ok):
            self.first_ok[pid] = time.monotonic() - self.kill_t

    async def one_request(self, pid: str, body: dict[str, Any], stream: bool) -> bool:
        """One step's request; True if it completed. Clean failures (a 5xx or 429 with
        Retry-After, a stream ended by an error event) are retried, and so are connection
        failures while the gateway restarts; anything else gives the step up."""
        st = self.stats
        while True:
            st.sent += 1
            t0 = time.perf_counter()
            started = time.monotonic()
            delay = 0.0
            try:
                async with self.s.post(self.base + "/v1/chat/completions", json=body) as r:
                    if r.status == 200:
                        ok, why, event = await (self._read_stream(r) if stream
                                                else self._read_json(r))
                        if ok:
                            st.completed += 1
                            st.latencies.append(time.perf_counter() - t0)
                            self.note_ok(pid, started)
                            return True
                        if event:  # the stream ended with an error event: clean
                            st.answer("stream error event", True, why, self.rt())
                            st.retries["stream error event"] += 1
                            delay = self.args.stream_retry_s
                        elif stream and self.in_restart():
                            st.restart_retries["stream cut"] += 1
                            if await self.wait_gateway():
                                st.gave_up_at_end += 1
                                return False
                            continue
                        else:
                            kind = "stream cut without error event" if stream else "bad body"
                            st.answer(kind, False, why, self.rt())
                            st.error(kind, why)
                            return False
                    else:
                        text = await r.text()
                        ra = r.headers.get("Retry-After")
                        try:
                            retry_after = float(ra) if ra is not None else None
                        except ValueError:
                            retry_after = None
                        if retry_after is not None and (r.status >= 500 or r.status == 429):
                            st.answer(f"http {r.status} + Retry-After", True, text, self.rt())
                            st.retries[str(r.status)] += 1
                            delay = retry_after
                        else:
                            kind = f"http {r.status}" + (" without Retry-After" if ra is None
                                                         else f" Retry-After {ra!r}")
                            st.answer(kind, False, text, self.rt())
                            st.error(f"http {r.status}", text)
                            return False
            except aiohttp.ClientError as e:
                if self.in_restart():
                    st.restart_retries[type(e).__name__] += 1
                    if await self.wait_gateway():
                        st.gave_up_at_end += 1
                        return False
                    continue
                st.answer(type(e).__name__, False, repr(e), self.rt())
                st.error(type(e).__name__, repr(e))
                return False
            except TimeoutError as e:
                st.answer("timeout", False, repr(e), self.rt())
                st.error("TimeoutError", repr(e))
                return False
            if await self.sleep_until_stop(delay * self.rng.uniform(1.0, 1.5)):
                st.gave_up_at_end += 1
                return False

    @staticmethod
    async def _read_json(r: aiohttp.ClientResponse) -> tuple[bool, str, bool]:
        raw = await r.read()
        try:
            data = json.loads(raw)
        except ValueError:
            return False, raw[:300].decode(errors="replace"), False
        if isinstance(data, dict) and data.get("choices"):
            return True, "", False
        return False, raw[:300].decode(errors="replace"), False

    @staticmethod
    async def _read_stream(r: aiohttp.ClientResponse) -> tuple[bool, str, bool]:
        """(ended well, why not, ended by an error event)."""
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
                return False, payload[:300].decode(errors="replace"), True
            chunks += 1
        if not done:
            return False, f"stream ended without [DONE] after {chunks} chunks", False
        return True, "", False

    async def release(self, pid: str) -> None:
        while True:
            try:
                async with self.s.post(f"{self.base}/v1/programs/{pid}/release") as r:
                    await r.read()
                    if r.status == 200:
                        self.stats.released += 1
                        self.released_ids.add(pid)
                    else:
                        self.stats.release_errors[f"http {r.status}"] += 1
                    return
            except aiohttp.ClientError as e:
                if self.in_restart():
                    self.stats.restart_retries["release " + type(e).__name__] += 1
                    if not await self.wait_gateway():
                        continue
                self.stats.release_errors[type(e).__name__] += 1
                return
            except TimeoutError as e:
                self.stats.release_errors[type(e).__name__] += 1
                return

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
                await self.one_request(pid, body, stream)
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
            return len(await list_programs(self.s, self.base))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return None


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
    base = f"http://127.0.0.1:{port}"
    engines: list[Child] = []
    engine_urls: list[str] = []
    backend_args: list[str] = []
    if args.engines:
        for i, ecmd in enumerate(engine_cmds(args, serve_args, scale)):
            log = tempfile.mkstemp(prefix=f"mori-soak-engine{i}-", suffix=".log")[1]
            engines.append(Child(f"engine {i}", ecmd, log))
            url = f"http://127.0.0.1:{ecmd[ecmd.index('--port') + 1]}"
            engine_urls.append(url)
            backend_args += ["--backend", f"sim={url}"]
        backend_args += FAULT_SERVE_DEFAULTS
    cmd = [sys.executable, "-m", "mori", "serve", "--port", str(port),
           "--time-scale", str(args.time_scale), "--program-idle-timeout", str(args.program_ttl),
           "--log-level", args.log_level, *backend_args, *serve_args]
    log_path = args.serve_log or tempfile.mkstemp(prefix="mori-soak-", suffix=".log")[1]
    if args.serve_log:
        open(log_path, "wb").close()  # a fresh log (the child appends)
    gw = Child("mori serve", cmd, log_path)
    samples: list[Sample] = []
    result: dict[str, Any] = {}
    try:
        for e in engines:
            e.start()
        for e, url in zip(engines, engine_urls, strict=True):
            await wait_up(url + "/health", e)
            print(f"{e.name}: {' '.join(e.cmd[1:])} (pid {e.pid}, log {e.log_path})",
                  file=sys.stderr, flush=True)
        gw.start()
        print(f"serve: {' '.join(cmd[1:])} (pid {gw.pid}, log {log_path}, nofile {nofile})",
              file=sys.stderr, flush=True)
        await wait_up(base + "/healthz", gw)
        conn = aiohttp.TCPConnector(limit=args.programs + 100, limit_per_host=0,
                                    force_close=False)
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            async with s.get(base + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            soak = Soak(args, base, model, s)
            faults = Faults(args, soak, gw, engines, engine_urls)
            st = soak.stats
            t0 = soak.t0 = time.monotonic()
            soak.deadline = t0 + args.seconds
            tasks = [asyncio.create_task(soak.slot(i)) for i in range(args.programs)]
            fault_tasks = []
            if args.kill_engine_at is not None:
                fault_tasks.append(asyncio.create_task(faults.kill_engine()))
            if args.restart_gateway_at is not None:
                fault_tasks.append(asyncio.create_task(faults.restart_gateway()))

            async def sampler() -> None:
                while True:
                    pid = gw.pid if not soak.gw_down else None
                    samples.append(Sample(time.monotonic() - t0,
                                          rss_mb(pid) if pid is not None else None,
                                          await soak.listed(), st.completed))
                    await asyncio.sleep(args.rss_interval)

            samp = asyncio.create_task(sampler())
            bar = tqdm(total=int(args.seconds), unit="s", file=sys.stderr, dynamic_ncols=True,
                       disable=args.no_progress)
            last_done, last_t = 0, t0
            died = False
            while (now := time.monotonic()) < soak.deadline:
                await asyncio.sleep(min(1.0, soak.deadline - now))
                if not soak.gw_down and not gw.alive():
                    note(f"\nmori serve exited mid-run:\n{tail(log_path, 30)}")
                    died = True
                    break
                if any(t.done() and not t.cancelled() and t.exception() is not None
                       for t in fault_tasks):
                    note("a fault task failed (see the report)")
                    died = True
                    break
                now = time.monotonic()
                bar.n = min(int(now - t0), int(args.seconds))
                rate = (st.completed - last_done) / max(now - last_t, 1e-9)
                last_done, last_t = st.completed, now
                rss = samples[-1].rss_mb if samples else None
                bar.set_postfix(sent=st.sent, done=st.completed, rps=f"{rate:.0f}",
                                clean=sum(st.clean.values()),
                                unclean=sum(st.unclean.values()),
                                rr=sum(st.restart_retries.values()),
                                rss=f"{rss:.0f}M" if rss else "?", refresh=False)
                bar.refresh()
            bar.close()
            soak.stop.set()
            wall = time.monotonic() - t0
            fault_errors = []
            for t in fault_tasks:
                try:
                    await asyncio.wait_for(t, 120)
                except Exception as exc:  # reported, and the run fails
                    fault_errors.append(repr(exc))
            # let in-flight requests end (and programs release) before counting
            _, pending = await asyncio.wait(tasks, timeout=args.request_timeout + 10)
            for t in pending:
                t.cancel()
            drain_s = time.monotonic() - t0 - wall
            samp.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await samp
            samples.append(Sample(time.monotonic() - t0, rss_mb(gw.pid) if gw.pid else None,
                                  await soak.listed(), st.completed))
            listed_end = samples[-1].listed
            listed_after_ttl = None
            tick_wall = 5.0 / scale  # the default --tick, in wall seconds
            wait_ttl = (ttl + 2 * tick_wall + 2) if args.wait_ttl and ttl > 0 else 0.0
            if wait_ttl and not died:
                print(f"waiting {wait_ttl:.0f} s for the program TTL ({ttl:g} s) ...",
                      file=sys.stderr, flush=True)
                await asyncio.sleep(wait_ttl)
                listed_after_ttl = await soak.listed()
            metrics = ""
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
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
        metric_names = ("mori_requests_total", "mori_held_requests_total",
                        "mori_upstream_errors_total", "mori_client_disconnects_total",
                        "mori_promotions_total", "mori_demotions_total", "mori_programs",
                        "mori_failover_programs_total")
        result = {
            "config": dict(vars(args)),
            "serve_cmd": cmd[1:], "nofile": nofile, "wall_s": wall, "drain_s": drain_s,
            "sent": st.sent, "completed": st.completed,
            "completed_per_s": st.completed / wall if wall else float("nan"),
            "errors": dict(st.errors), "error_samples": st.error_samples,
            "errors_total": sum(st.errors.values()),
            "clean": dict(st.clean), "clean_total": sum(st.clean.values()),
            "unclean": dict(st.unclean), "unclean_total": sum(st.unclean.values()),
            "unclean_samples": st.unclean_samples,
            "retries": dict(st.retries),
            "restart_retries": dict(st.restart_retries),
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
            "serve_log": log_path,
            "serve_alive": gw.alive(),
            "gateway_metrics": {name: metric_sum(metrics, name) for name in metric_names},
        }
        if engines or fault_tasks:
            first = sorted(soak.first_ok.values())
            kill = faults.kill
            if kill is not None:
                kill["programs_with_a_200_after"] = len(first)
                kill["first_200_after_s"] = first[0] if first else None
                kill["p50_first_200_after_s"] = pct(first, 50) if first else None
                kill["max_first_200_after_s"] = first[-1] if first else None
            restored = [ln.rstrip() for ln in log_lines if "restored" in ln
                        and "residency" in ln]
            before = faults.metrics_before_restart
            result["faults"] = {
                "engines": [{"url": u, "log": e.log_path, "starts": e.starts}
                            for u, e in zip(engine_urls, engines, strict=True)],
                "events": faults.events, "engine_kill": kill,
                "gateway_restart": faults.restart, "restore_log": restored,
                "fault_task_errors": fault_errors,
                "gateway_metrics_before_restart": (
                    {name: metric_sum(before, name) for name in metric_names}
                    if before is not None else None),
            }
    finally:
        gw.stop_now()
        for e in engines:
            e.stop_now()
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
    f = ap.add_argument_group("fault injection")
    f.add_argument("--engines", type=int, default=0,
                   help="start N `mori engine-sim` processes and serve them as --backend "
                        "(0: the engines run in serve's process)")
    f.add_argument("--kill-engine-at", type=float, default=None, metavar="S",
                   help="SIGKILL an engine S seconds in (needs --engines)")
    f.add_argument("--kill-engine", type=int, default=1, metavar="I",
                   help="which engine (the gateway's replica index) to kill")
    f.add_argument("--engine-down-s", type=float, default=10.0, metavar="D",
                   help="start the killed engine again (empty) D seconds after the kill")
    f.add_argument("--restart-gateway-at", type=float, default=None, metavar="S",
                   help="stop mori serve (SIGTERM) S seconds in and start it again")
    f.add_argument("--restart-grace", type=float, default=2.0, metavar="S",
                   help="connection failures up to S seconds after the restarted gateway "
                        "answers still count as the restart's (retried)")
    f.add_argument("--stream-retry-s", type=float, default=1.0, metavar="S",
                   help="retry a step whose stream ended with an error event after S s")
    args = ap.parse_args()
    if args.kill_engine_at is not None and not 0 <= args.kill_engine < args.engines:
        ap.error("--kill-engine-at needs --engines N with --kill-engine below N")
    res = asyncio.run(run(args))
    report(res, args.table_rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)
    faulted = "faults" in res
    lost = (res["faults"]["gateway_restart"] or {}).get("lost", 0) if faulted else 0
    ok = (res["unclean_total"] == 0 and res["serve_alive"] and not lost
          and (faulted or res["errors_total"] == 0)
          and not (faulted and res["faults"]["fault_task_errors"]))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
