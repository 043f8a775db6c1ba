"""Gateway overhead: latency added and throughput, against sglang-router's ``smg``.

One trivial upstream (``bench/trivial_upstream.py``: answers every completion at once,
so what is measured is the gateway) is reached three ways, each driven by ``wrk`` (one
thread, keep-alive connections, non-streaming chat completions) for ``--seconds`` at
each connection count: straight (``direct``), through SGLang's Rust router ``smg`` (from
PyPI ``sglang-router``; ``--against smg``), and through ``mori serve`` (``--backend
openai=...``). Each request names one of ``--programs`` program ids in turn, so MORI
sees agent programs come back step after step. Reports p50/p99 latency and requests/s
per target and the latency each gateway adds to ``direct`` (p50 difference), measured
in the same run since these machines are shared and noisy; ``--rounds`` repeats the
whole sweep. With ``--against smg`` it ends with the headroom targets (added p50 at 1
connection at most 2x ``smg``'s, p99 at 16 at most 10 ms, requests/s at 64 at least 0.5x
``smg``'s): each round's figure and the median. All processes share this machine's
cores.

Two measurements for changes to the gateway itself: ``--baseline-src DIR`` runs a second
``mori serve`` from another checkout's ``src`` folder (``PYTHONPATH=DIR``; e.g. from
``git worktree add /tmp/before REV``) as the target ``before``, measured in the same
rounds as ``mori`` (the two alternate which goes first), and ends with mori's figures as
multiples of before's. ``--cpu`` reports the CPU time each gateway used per request
(from ``/proc``: the process and its children; for ``mori serve --workers`` also the
policy process and the workers apart), and the upstream's.

    python bench/bench_gateway.py --against smg [--connections 1,16,64] [--seconds 5]
        [--rounds 4] [--smg PATH] [--workers N] [--baseline-src DIR] [--cpu]
        [--json out.json]

Needs ``wrk`` (Debian: ``apt-get install wrk``) and, for ``--against smg``, the ``smg``
command (``pip install sglang-router``, best in its own virtual environment; ``--smg``
gives its path).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchutil import child_pids, cpu_seconds, free_port

HERE = Path(__file__).resolve().parent

WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
request = function()
  n = n + 1
  local body = '{"model":"trivial","max_tokens":1,"program_id":"p' .. (n % PROGRAMS) ..
    '","messages":[{"role":"user","content":"hello there"}]}'
  return wrk.format(nil, nil, nil, body)
end
done = function(summary, latency, requests)
  local errs = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %d, "seconds": %f, "p50_us": %d, "p90_us": %d, "p99_us": %d, ' ..
    '"non2xx": %d, "socket_errors": %d}\\n',
    summary.requests, summary.duration / 1e6, latency:percentile(50),
    latency:percentile(90), latency:percentile(99), summary.errors.status,
    errs.connect + errs.read + errs.write + errs.timeout))
end
"""


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None
          ) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def cpu_of(pid: int) -> dict[str, float]:
    """CPU seconds so far of process ``pid`` (``own``) and of each of its children, by
    pid (a worker restarted between two looks is a new pid: it counts from zero)."""
    out = {"own": cpu_seconds(pid) or 0.0}
    for child in child_pids(pid):
        out[str(child)] = cpu_seconds(child) or 0.0
    return out


def cpu_per_request(before: dict[str, float], after: dict[str, float],
                    requests: int) -> dict[str, float]:
    """Microseconds of CPU per request between two ``cpu_of`` looks: ``total``, the
    parent's ``own`` and its ``children`` together."""
    used = {k: v - before.get(k, 0.0) for k, v in after.items()}
    n = max(requests, 1)
    own = used.pop("own")
    kids = sum(used.values())
    return {"total": (own + kids) / n * 1e6, "own": own / n * 1e6, "children": kids / n * 1e6}


def wait_up(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 90.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout} s; log: {log.read_text()[-2000:]}")


def run_wrk(url: str, connections: int, seconds: float, script: Path) -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s",
           "-s", str(script), url + "/v1/chat/completions"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next((ln for ln in out.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    r: dict[str, Any] = json.loads(line[len("WRKJSON "):])
    r["rps"] = r["requests"] / r["seconds"]
    return r


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--against", choices=["smg", "none"], default="smg",
                    help="the router to compare with (none: direct and mori only)")
    ap.add_argument("--connections", default="1,16,64",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--programs", type=int, default=1000,
                    help="distinct program ids the requests cycle through")
    ap.add_argument("--smg", default=None, help="path of the smg command (default: on PATH)")
    ap.add_argument("--workers", type=int, default=None,
                    help="mori serve --workers (default: mori's default)")
    ap.add_argument("--baseline-src", default=None, metavar="DIR",
                    help="also measure a mori serve run from this src folder (target 'before')")
    ap.add_argument("--cpu", action="store_true",
                    help="report CPU time per request of each gateway and of the upstream")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.baseline_src is not None and not (Path(args.baseline_src) / "mori").is_dir():
        sys.exit(f"bench_gateway: --baseline-src {args.baseline_src}: no mori package there "
                 "(give the src folder of a checkout)")
    if shutil.which("wrk") is None:
        sys.exit("bench_gateway: wrk is not installed (Debian: apt-get install wrk)")
    smg = args.smg or shutil.which("smg")
    if args.against == "smg" and (smg is None or not Path(smg).exists()):
        sys.exit("bench_gateway: smg not found; pip install sglang-router (or give --smg PATH)")

    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    script = tmp / "post.lua"
    script.write_text(f"local PROGRAMS = {args.programs}\n" + WRK_SCRIPT)
    uport, gport, sport, bport = free_port(), free_port(), free_port(), free_port()
    direct = f"http://127.0.0.1:{uport}"
    procs: list[subprocess.Popen[bytes]] = []
    targets = {"direct": direct, "mori": f"http://127.0.0.1:{gport}"}
    try:
        up = start([sys.executable, str(HERE / "trivial_upstream.py"), "--port", str(uport)],
                   tmp / "upstream.log")
        procs.append(up)
        wait_up(direct + "/health", up, tmp / "upstream.log")
        mori_cmd = [sys.executable, "-m", "mori", "serve", "--backend",
                    f"openai={direct},kv_tokens=100000000", "--port", str(gport),
                    "--log-level", "warning"]
        if args.workers is not None:
            mori_cmd += ["--workers", str(args.workers)]
        gw = start(mori_cmd, tmp / "mori.log")
        procs.append(gw)
        pids = {"direct": up.pid, "mori": gw.pid}
        if args.baseline_src is not None:
            bcmd = [*mori_cmd[:mori_cmd.index("--port") + 1], str(bport),
                    *mori_cmd[mori_cmd.index("--port") + 2:]]
            base = start(bcmd, tmp / "before.log",
                         env={"PYTHONPATH": str(Path(args.baseline_src).resolve())})
            procs.append(base)
            pids["before"] = base.pid
        if args.against == "smg":
            assert smg is not None
            router = start([smg, "launch", "--host", "127.0.0.1", "--port", str(sport),
                            "--worker-urls", direct, "--policy", "round_robin",
                            "--log-level", "warn", "--disable-retries",
                            "--disable-circuit-breaker"], tmp / "smg.log")
            procs.append(router)
            targets = {"direct": direct, "smg": f"http://127.0.0.1:{sport}",
                       "mori": targets["mori"]}
            pids["smg"] = router.pid
            wait_up(targets["smg"] + "/health", router, tmp / "smg.log")
        wait_up(targets["mori"] + "/healthz", gw, tmp / "mori.log")
        if args.baseline_src is not None:
            targets["before"] = f"http://127.0.0.1:{bport}"
            wait_up(targets["before"] + "/healthz", base, tmp / "before.log")
        for url in targets.values():  # warm up every path
            run_wrk(url, 4, 1, script)
        rows: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            for c in args.connections:
                row: dict[str, Any] = {"round": rnd + 1, "connections": c}
                order = list(targets)
                if "before" in targets and rnd % 2:  # alternate which of the two goes first
                    i, j = order.index("mori"), order.index("before")
                    order[i], order[j] = order[j], order[i]
                for name in order:
                    if args.cpu:
                        look = cpu_of(pids[name]), cpu_of(up.pid)
                    row[name] = run_wrk(targets[name], c, args.seconds, script)
                    if args.cpu:
                        n = row[name]["requests"]
                        row[name]["cpu_us"] = cpu_per_request(look[0], cpu_of(pids[name]), n)
                        row[name]["upstream_cpu_us"] = cpu_per_request(
                            look[1], cpu_of(up.pid), n)["total"]
                for name in targets:
                    if name != "direct":
                        row[f"{name}_added_p50_ms"] = (row[name]["p50_us"]
                                                       - row["direct"]["p50_us"]) / 1e3
                rows.append(row)
                print(f"round {rnd + 1} c={c:<3d} " + " | ".join(
                    f"{n} p50 {row[n]['p50_us'] / 1e3:6.2f} ms p99 {row[n]['p99_us'] / 1e3:6.2f}"
                    f" ms {row[n]['rps']:7.0f} req/s"
                    + (f" (+{row[n + '_added_p50_ms']:.2f} ms)" if n != "direct" else "")
                    + (f" non2xx {row[n]['non2xx']}" if row[n]["non2xx"] else "")
                    + (f" sockerr {row[n]['socket_errors']}" if row[n]["socket_errors"] else "")
                    for n in targets), flush=True)
                if args.cpu:
                    print("         cpu per request: " + " | ".join(
                        f"{n} {cpu_text(row[n]['cpu_us'])}" for n in targets if n != "direct")
                        + f" | upstream {row['mori']['upstream_cpu_us']:.0f} us (during mori)",
                        flush=True)
        if "smg" in targets:
            for line in against_targets(rows):
                print(line)
        if "before" in targets:
            for line in against_before(rows, args.cpu):
                print(line)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    finally:
        stop(procs[::-1])


def cpu_text(cpu: dict[str, float]) -> str:
    if cpu["children"] and cpu["own"]:
        return (f"{cpu['total']:.0f} us (policy process {cpu['own']:.0f}, "
                f"workers {cpu['children']:.0f})")
    return f"{cpu['total']:.0f} us"


def against_before(rows: list[dict[str, Any]], cpu: bool) -> list[str]:
    """mori's p50 latency, requests/s (and CPU per request) as multiples of the
    ``before`` target's, at each connection count: the median over rounds."""
    out = []
    for c in dict.fromkeys(r["connections"] for r in rows):
        at = [r for r in rows if r["connections"] == c]
        p50 = statistics.median(r["mori"]["p50_us"] / max(r["before"]["p50_us"], 1) for r in at)
        rps = statistics.median(r["mori"]["rps"] / max(r["before"]["rps"], 1e-9) for r in at)
        line = (f"mori vs before c={c:<3d}: p50 {p50:.2f}x, req/s {rps:.2f}x")
        if cpu:
            per = statistics.median(r["mori"]["cpu_us"]["total"]
                                    / max(r["before"]["cpu_us"]["total"], 1e-9) for r in at)
            line += f", CPU per request {per:.2f}x"
        out.append(line + f" (median of {len(at)} rounds)")
    return out


def against_targets(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 13's three headroom targets, each round and the median over rounds: added
    p50 at 1 connection <= 2x smg's, p99 at 16 connections <= 10 ms, req/s at 64
    connections >= 0.5x smg's."""
    checks: dict[int, tuple[str, Callable[[dict[str, Any]], float], str,
                            Callable[[float], bool]]]
    checks = {1: ("added p50 vs smg", lambda r: r["mori_added_p50_ms"]
                  / max(r["smg_added_p50_ms"], 1e-3), "x", lambda v: v <= 2.0),
              16: ("p99", lambda r: r["mori"]["p99_us"] / 1e3, " ms", lambda v: v <= 10.0),
              64: ("req/s vs smg", lambda r: r["mori"]["rps"] / r["smg"]["rps"], "x",
                   lambda v: v >= 0.5)}
    out = []
    for c, (what, value, unit, ok) in checks.items():
        vals = [value(r) for r in rows if r["connections"] == c]
        if not vals:
            continue
        med = statistics.median(vals)
        rounds = ", ".join(f"{v:.2f}" for v in vals)
        out.append(f"target c={c:<3d} mori {what}: median {med:.2f}{unit} "
                   f"({'met' if ok(med) else 'not met'}; rounds: {rounds}; "
                   f"met in {sum(map(ok, vals))}/{len(vals)})")
    return out


if __name__ == "__main__":
    main()
