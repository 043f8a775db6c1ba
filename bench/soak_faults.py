"""The soak bench's child processes (``mori serve``, ``mori engine-sim``) and the faults
it injects into them (``bench_soak.py --engines``, ``--kill-engine-at``,
``--restart-gateway-at``): an engine killed and started again, the gateway restarted,
and what each showed (failover, placement kept or lost)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from tqdm import tqdm

from bench.benchutil import free_port, tail
from bench.soak_report import metric_sum, placement, serve_flag

if TYPE_CHECKING:
    from bench.bench_soak import Soak

# the children run without these, so the bench can read the engines and the gateway
CHILD_ENV_DROP = ("MORI_ENGINE_TOKEN", "MORI_API_KEYS", "MORI_ADMIN_KEYS")
FAULT_SERVE_DEFAULTS = ["--health-interval", "0.5", "--health-timeout", "1"]
LIST_PAGE = 10_000  # programs a /v1/programs page is asked for (the gateway's most)


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CHILD_ENV_DROP}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def note(msg: str) -> None:
    tqdm.write(msg, file=sys.stderr)


class Child:
    """A child process (``mori serve``, ``mori engine-sim``) writing to a log file; it can
    be stopped and started again with the same command (the log is appended to)."""

    def __init__(self, name: str, cmd: list[str], log_path: str) -> None:
        self.name, self.cmd, self.log_path = name, cmd, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        with open(self.log_path, "ab") as log_f:
            if self.starts:
                log_f.write(f"---- {self.name} started again ----\n".encode())
                log_f.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log_f, stderr=subprocess.STDOUT,
                                         env=child_env())
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    async def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout`` s); the exit status."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.terminate()
            try:
                await asyncio.to_thread(p.wait, timeout)
            except subprocess.TimeoutExpired:
                note(f"{self.name} did not stop within {timeout:g} s: SIGKILL")
                p.kill()
                await asyncio.to_thread(p.wait)
        return p.returncode

    def stop_now(self, timeout: float = 15.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def list_programs(s: aiohttp.ClientSession, base: str,
                        timeout: float = 30.0) -> list[dict[str, Any]]:
    """Every program the gateway lists (``/v1/programs``, page after page)."""
    rows: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params = {"limit": str(LIST_PAGE)} | ({"after": after} if after else {})
        async with s.get(base + "/v1/programs", params=params,
                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            r.raise_for_status()
            d = await r.json()
        rows += d["data"]
        after = d.get("last_id")
        if not d.get("has_more") or not after:
            return rows


async def wait_up(url: str, child: Child, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as s:
        while time.monotonic() - t0 < timeout:
            if child.proc is None or child.proc.poll() is not None:
                rc = child.proc.returncode if child.proc is not None else None
                raise RuntimeError(f"{child.name} exited ({rc}): "
                                   f"{tail(child.log_path, 30)}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


class Faults:
    """The injected faults (``--kill-engine-at``, ``--restart-gateway-at``) and what they
    showed."""

    def __init__(self, args: argparse.Namespace, soak: Soak, gw: Child,
                 engines: list[Child], engine_urls: list[str]) -> None:
        self.args, self.soak, self.gw = args, soak, gw
        self.engines, self.engine_urls = engines, engine_urls
        self.s = soak.s
        self.events: list[dict[str, Any]] = []
        self.kill: dict[str, Any] | None = None
        self.restart: dict[str, Any] | None = None
        self.metrics_before_restart: str | None = None

    def event(self, what: str, **kw: Any) -> None:
        t = self.soak.rt()
        self.events.append({"t": round(t, 2), "event": what, **kw})
        extra = " ".join(f"{k}={v}" for k, v in kw.items())
        note(f"[t={t:6.1f} s] {what} {extra}".rstrip())

    async def get_json(self, url: str, timeout: float = 10.0) -> Any:
        async with self.s.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            r.raise_for_status()
            return await r.json()

    async def programs(self) -> dict[str, int | None]:
        """Every program the gateway lists, with its replica."""
        rows = await list_programs(self.s, self.soak.base)
        return {row["program_id"]: row.get("replica") for row in rows}

    async def metrics(self) -> str:
        async with self.s.get(self.soak.base + "/metrics",
                              timeout=aiohttp.ClientTimeout(total=10)) as r:
            return await r.text()

    async def residency(self) -> list[dict[str, dict[str, int]]]:
        """Each engine's ``/mori/v1/residency`` ({} for one that does not answer)."""
        out = []
        for url in self.engine_urls:
            try:
                out.append(await self.get_json(url + "/mori/v1/residency"))
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                note(f"residency of {url} unread: {e!r}")
                out.append({})
        return out

    async def replica_healthy(self, index: int) -> bool | None:
        try:
            d = await self.get_json(self.soak.base + "/healthz", 2.0)
            return bool(d["replicas"][index]["healthy"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError):
            return None

    async def wait_replica(self, index: int, healthy: bool, since: float,
                           timeout: float) -> float | None:
        """Seconds from ``since`` until the gateway shows the replica as ``healthy``."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.soak.stop.is_set():
            if await self.replica_healthy(index) is healthy:
                return time.monotonic() - since
            await asyncio.sleep(0.05)
        return None

    async def at(self, t: float) -> bool:
        """Sleep until run second ``t``; False if the run ends first."""
        return not await self.soak.sleep_until_stop(self.soak.t0 + t - time.monotonic())

    async def kill_engine(self) -> None:
        a, soak = self.args, self.soak
        i = a.kill_engine
        if not await self.at(a.kill_engine_at):
            return
        try:
            progs = await self.programs()
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            note(f"programs unread before the kill: {e!r}")
            progs = {}
        soak.on_killed = {pid for pid, r in progs.items() if r == i}
        eng = self.engines[i]
        soak.kill_t = kill_t = time.monotonic()
        eng.kill()
        self.event("engine killed", engine=i, programs_on_it=len(soak.on_killed))
        detect = asyncio.create_task(self.wait_replica(i, False, kill_t, a.engine_down_s + 60))
        await soak.sleep_until_stop(a.engine_down_s)
        eng.start()
        await wait_up(self.engine_urls[i] + "/health", eng)
        back_t = time.monotonic()
        self.event("engine started again", engine=i, pid=eng.pid)
        detect_s = await detect
        rejoin_s = await self.wait_replica(i, True, back_t, 60)
        self.event("replica healthy again", engine=i,
                   after_s=None if rejoin_s is None else round(rejoin_s, 2))
        up_from_kill = None if rejoin_s is None else back_t + rejoin_s - kill_t
        failover: float | None = None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            text = await self.metrics()
            failover = sum(metric_sum(text, "mori_failover_programs_total").values())
        self.kill = {"engine": i, "at_s": round(kill_t - soak.t0, 2),
                     "programs_on_it": len(soak.on_killed), "down_s": a.engine_down_s,
                     "marked_unhealthy_after_s": detect_s,
                     "healthy_again_after_restart_s": rejoin_s,
                     "healthy_again_after_kill_s": up_from_kill,
                     "failover_programs_total": failover}

    async def restart_gateway(self) -> None:
        a, soak, gw = self.args, self.soak, self.gw
        if not await self.at(a.restart_gateway_at):
            return
        before = await self.programs()
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            self.metrics_before_restart = await self.metrics()
        soak.gw_down = True
        soak.gw_up.clear()
        t_stop = time.monotonic()
        self.event("gateway SIGTERM", pid=gw.pid, programs=len(before))
        try:
            rc = await gw.stop(60.0)
            stopped_s = time.monotonic() - t_stop
            self.event("gateway stopped", rc=rc, after_s=round(stopped_s, 2))
            gw.start()
            await wait_up(soak.base + "/healthz", gw)
            up_s = time.monotonic() - t_stop
            self.event("gateway up again", pid=gw.pid, after_s=round(up_s, 2))
            res = await self.residency()
            after = await self.programs()
        finally:
            soak.gw_down = False
            soak.gw_up_at = time.monotonic()
            soak.gw_up.set()
        pl = placement(before, after, res)
        new = [pid for pid in after if pid not in before]
        pl["restored_released_by_client"] = sum(pid in soak.released_ids for pid in new)
        self.event("placement at restart", kept=pl["kept"], lost=pl["lost"],
                   moved_to_kv=pl["moved_to_replica_with_kv"])
        self.restart = {"at_s": round(t_stop - soak.t0, 2), "stop_rc": rc,
                        "stopped_after_s": stopped_s, "up_after_s": up_s,
                        "programs_before": len(before), "programs_after": len(after), **pl}


def engine_cmds(args: argparse.Namespace, serve_args: list[str], scale: float
                ) -> list[list[str]]:
    """``mori engine-sim`` commands shaped as ``mori serve`` would shape its in-process
    engines (preset, CPU tier, typed eviction by the policy's engine; free ports)."""
    from mori.core.policies import POLICIES
    from mori.gateway.config import GatewaySettings
    from mori.gateway.server import ServeConfig

    dflt = ServeConfig()
    policy = serve_flag(serve_args, "--policy") or GatewaySettings().policy
    profile = POLICIES.get(policy).engine_profile
    preset = serve_flag(serve_args, "--preset") or dflt.preset
    cpu = float(serve_flag(serve_args, "--cpu-ratio") or dflt.cpu_ratio)
    gpu = serve_flag(serve_args, "--gpu-kv-tokens")
    cmds = []
    for _ in range(args.engines):
        c = [sys.executable, "-m", "mori", "engine-sim", "--preset", preset,
             "--port", str(free_port()), "--time-scale", f"{scale:g}",
             "--cpu-ratio", f"{cpu if profile.cpu_tier else 0.0:g}"]
        if profile.typed_eviction:
            c.append("--typed-eviction")
        if gpu is not None:
            c += ["--gpu-kv-tokens", gpu]
        cmds.append(c)
    return cmds
