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

The agents' APIs: ``--api chat,messages,responses`` (any of ``chat``, ``completions``,
``messages``, ``count_tokens``, ``responses``; default ``chat``) measures each path in the
same rounds, the order of the paths turning round by round, against an upstream that
answers each API with a minimal valid body (``--serve-upstream``, this script itself). The
requests are the ones each client sends, small: chat names its program in the body's
``program_id`` (the default run, as before) or, with more than one API, in the
``X-Program-Id`` header; ``messages`` is Claude Code's (``/v1/messages?beta=true``, system
and message blocks with ``cache_control``, a tool, the session in ``metadata.user_id``, a
JSON string); ``count_tokens`` its token counting; ``responses`` Codex's (the
``session-id`` header, ``prompt_cache_key``, ``instructions``, an input message, a
function tool); ``completions`` a prompt with ``program_id``. Each run of ``wrk`` uses one
path, non-streamed. It ends with each path's p50/p99 and requests/s through ``mori`` and
``direct`` and the p50 it adds, as a multiple of the chat path's added p50 (target: at
most 1.2x): the median over rounds. ``smg`` (``--against smg``) is measured on chat only.

    python bench/bench_gateway.py --api chat,messages,responses --against none
        [--connections 1,16] [--rounds 3] [--seconds 3]

Needs ``wrk`` (Debian: ``apt-get install wrk``) and, for ``--against smg``, the ``smg``
command (``pip install sglang-router``, best in its own virtual environment; ``--smg``
gives its path).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import child_pids, cpu_seconds, free_port

HERE = Path(__file__).resolve().parent

_WRK_HEAD = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local n = 0
"""
_WRK_CHAT = """
request = function()
  n = n + 1
  local body = '{"model":"trivial","max_tokens":1,"program_id":"p' .. (n % PROGRAMS) ..
    '","messages":[{"role":"user","content":"hello there"}]}'
  return wrk.format(nil, nil, nil, body)
end
"""
_WRK_DONE = """
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
WRK_SCRIPT = _WRK_HEAD + _WRK_CHAT + _WRK_DONE
"""The default run's script: chat completions naming ``PROGRAMS`` program ids in turn."""

# -- the agents' APIs (--api) ----------------------------------------------------------------
# Each request function names program n % PROGRAMS the way its client does; wrk.format
# with a headers table sends those headers only (Content-Type included).
_WRK_CHAT_HEADER = """
local headers = {["Content-Type"] = "application/json"}
request = function()
  n = n + 1
  headers["X-Program-Id"] = "p" .. (n % PROGRAMS)
  return wrk.format(nil, nil, headers,
    '{"model":"trivial","max_tokens":1,"messages":[{"role":"user","content":"hello there"}]}')
end
"""
_WRK_COMPLETIONS = """
request = function()
  n = n + 1
  return wrk.format(nil, nil, nil, '{"model":"trivial","max_tokens":1,"program_id":"p' ..
    (n % PROGRAMS) .. '","prompt":"hello there"}')
end
"""
# Claude Code: anthropic-version, x-api-key; the session in metadata.user_id (JSON text)
_CLAUDE_BODY = r"""
local function claude_body(session, with_metadata)
  local body = '{"model":"trivial",' ..
    '"system":[{"type":"text","text":"You are Claude Code, a CLI for coding.",' ..
    '"cache_control":{"type":"ephemeral"}}],' ..
    '"messages":[{"role":"user","content":[{"type":"text","text":"list the files",' ..
    '"cache_control":{"type":"ephemeral"}}]}],' ..
    '"tools":[{"name":"Bash","description":"Run a shell command","input_schema":' ..
    '{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]}}]'
  if with_metadata then
    body = body .. ',"max_tokens":32000,"stream":false,"metadata":{"user_id":' ..
      '"{\\"device_id\\":\\"d0d0d0d0\\",\\"account_uuid\\":\\"\\",' ..
      '\\"session_id\\":\\"' .. session .. '\\"}"}'
  end
  return body .. '}'
end
local headers = {["Content-Type"] = "application/json", ["anthropic-version"] = "2023-06-01",
                 ["x-api-key"] = "none"}
"""
_WRK_MESSAGES = _CLAUDE_BODY + """
request = function()
  n = n + 1
  local session = string.format("5b9c1f8e-0000-4000-8000-%012d", n % PROGRAMS)
  return wrk.format(nil, nil, headers, claude_body(session, true))
end
"""
_WRK_COUNT_TOKENS = _CLAUDE_BODY + """
request = function()
  n = n + 1
  return wrk.format(nil, nil, headers, claude_body("", false))
end
"""
# Codex: the session-id header, prompt_cache_key the same session
_WRK_RESPONSES = """
local headers = {["Content-Type"] = "application/json", ["originator"] = "codex_cli_rs"}
request = function()
  n = n + 1
  local session = string.format("0199a0c0-0000-7000-8000-%012d", n % PROGRAMS)
  headers["session-id"] = session
  local body = '{"model":"trivial","instructions":"You are Codex, a coding agent.",' ..
    '"input":[{"type":"message","role":"user","content":[{"type":"input_text",' ..
    '"text":"list the files"}]}],"tools":[{"type":"function","name":"shell",' ..
    '"description":"Run a command","strict":false,"parameters":{"type":"object",' ..
    '"properties":{"command":{"type":"array","items":{"type":"string"}}}}}],' ..
    '"tool_choice":"auto","parallel_tool_calls":false,"store":false,"stream":false,' ..
    '"include":[],"max_output_tokens":1,"prompt_cache_key":"' .. session .. '"}'
  return wrk.format(nil, nil, headers, body)
end
"""

_MESSAGE = {"id": "msg_trivial", "type": "message", "role": "assistant", "model": "trivial",
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "max_tokens",
            "stop_sequence": None, "usage": {"input_tokens": 8, "output_tokens": 1}}
_RESPONSE = {"id": "resp_trivial", "object": "response", "created_at": 0,
             "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
             "model": "trivial", "output": [{
                 "type": "message", "id": "msg_trivial", "status": "incomplete",
                 "role": "assistant", "content": [{"type": "output_text", "text": "ok",
                                                   "annotations": []}]}],
             "usage": {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 0},
                       "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0},
                       "total_tokens": 9}}
_TEXT_COMPLETION = {"id": "cmpl-trivial", "object": "text_completion", "created": 0,
                    "model": "trivial", "choices": [{"index": 0, "text": "ok",
                                                     "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}}


@dataclass(frozen=True)
class ApiBench:
    """One API as ``--api`` measures it: the ``path`` requested (query included), the
    ``wrk`` request function (Lua), the upstream's answer to it (None: the chat
    completion of ``trivial_upstream``)."""

    path: str
    lua: str
    answer: dict[str, Any] | None


APIS = {
    "chat": ApiBench("/v1/chat/completions", _WRK_CHAT_HEADER, None),
    "completions": ApiBench("/v1/completions", _WRK_COMPLETIONS, _TEXT_COMPLETION),
    "messages": ApiBench("/v1/messages?beta=true", _WRK_MESSAGES, _MESSAGE),
    "count_tokens": ApiBench("/v1/messages/count_tokens?beta=true", _WRK_COUNT_TOKENS,
                             {"input_tokens": 8}),
    "responses": ApiBench("/v1/responses", _WRK_RESPONSES, _RESPONSE),
}


def api_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in APIS]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--api {text!r}: a comma-separated list of distinct APIs among "
            + ", ".join(APIS))
    return names


def serve_upstream(port: int) -> None:
    """``trivial_upstream``'s server, answering each API's path with its own minimal
    body (``APIS``): what ``--api`` runs against."""
    from bench import trivial_upstream as tu

    answers = {b"/v1/chat/completions": tu._response(b"200 OK", tu._COMPLETION)}
    for api in APIS.values():
        if api.answer is not None:
            path = api.path.split("?", 1)[0].encode()
            answers[path] = tu._response(b"200 OK", json.dumps(api.answer).encode())

    def route(method: bytes, path: bytes) -> bytes:
        if method == b"POST" and path in answers:
            return answers[path]
        return tu.default_route(method, path)

    serve = functools.partial(tu.serve, "127.0.0.1", port, route)

    try:
        import uvloop
    except ImportError:
        asyncio.run(serve())
    else:
        uvloop.run(serve())


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


def run_wrk(url: str, connections: int, seconds: float, script: Path,
            path: str = "/v1/chat/completions") -> dict[str, Any]:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--timeout", "10s",
           "-s", str(script), url + path]
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
    ap.add_argument("--api", type=api_list, default=["chat"], metavar="API[,API...]",
                    help="the client APIs to measure, each in every round: "
                    + ", ".join(APIS) + " (default chat)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-upstream", type=int, default=None, metavar="PORT",
                    help=argparse.SUPPRESS)  # the --api upstream (run by this script)
    args = ap.parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return
    if args.baseline_src is not None and not (Path(args.baseline_src) / "mori").is_dir():
        sys.exit(f"bench_gateway: --baseline-src {args.baseline_src}: no mori package there "
                 "(give the src folder of a checkout)")
    if shutil.which("wrk") is None:
        sys.exit("bench_gateway: wrk is not installed (Debian: apt-get install wrk)")
    smg = args.smg or shutil.which("smg")
    if args.against == "smg" and (smg is None or not Path(smg).exists()):
        sys.exit("bench_gateway: smg not found; pip install sglang-router (or give --smg PATH)")

    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    apis: list[str] = args.api
    classic = apis == ["chat"]  # the default run: as before, chat's program_id in the body
    scripts: dict[str, Path] = {}
    paths: dict[str, str] = {}
    for api in apis:
        scripts[api] = tmp / f"{api}.lua"
        scripts[api].write_text(f"local PROGRAMS = {args.programs}\n" + (
            WRK_SCRIPT if classic else _WRK_HEAD + APIS[api].lua + _WRK_DONE))
        paths[api] = APIS[api].path
    uport, gport, sport, bport = free_port(), free_port(), free_port(), free_port()
    direct = f"http://127.0.0.1:{uport}"
    procs: list[subprocess.Popen[bytes]] = []
    targets = {"direct": direct, "mori": f"http://127.0.0.1:{gport}"}
    try:
        up_cmd = ([sys.executable, str(HERE / "trivial_upstream.py"), "--port", str(uport)]
                  if classic else
                  [sys.executable, str(Path(__file__).resolve()), "--serve-upstream", str(uport)])
        up = start(up_cmd, tmp / "upstream.log")
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
        def measured(api: str) -> list[str]:  # smg routes the OpenAI paths only
            return [t for t in targets if t != "smg" or api in ("chat", "completions")]

        for api in apis:  # warm up every path; each must answer 2xx
            for name in measured(api):
                warm = run_wrk(targets[name], 4, 1, scripts[api], paths[api])
                if warm["non2xx"] or not warm["requests"]:
                    sys.exit(f"bench_gateway: {name} answered {api} ({paths[api]}) with "
                             f"{warm['non2xx']} non-2xx of {warm['requests']} requests; "
                             f"logs in {tmp}")
        rows: list[dict[str, Any]] = []
        turn = 0
        for rnd in range(args.rounds):
            for c in args.connections:
                # the paths take turns going first: one step on for each sweep
                order_apis = apis[turn % len(apis):] + apis[:turn % len(apis)]
                turn += 1
                for api in order_apis:
                    row = measure(api, rnd, c, measured(api), targets, pids, up.pid, scripts,
                                  paths, args)
                    rows.append(row)
                    names = measured(api)
                    print(f"round {rnd + 1} c={c:<3d} " + ("" if classic else f"{api:<12s} ")
                          + " | ".join(
                        f"{n} p50 {row[n]['p50_us'] / 1e3:6.2f} ms p99 "
                        f"{row[n]['p99_us'] / 1e3:6.2f} ms {row[n]['rps']:7.0f} req/s"
                        + (f" (+{row[n + '_added_p50_ms']:.2f} ms)" if n != "direct" else "")
                        + (f" non2xx {row[n]['non2xx']}" if row[n]["non2xx"] else "")
                        + (f" sockerr {row[n]['socket_errors']}" if row[n]["socket_errors"]
                           else "")
                        for n in names), flush=True)
                    if args.cpu:
                        print("         cpu per request: " + " | ".join(
                            f"{n} {cpu_text(row[n]['cpu_us'])}" for n in names
                            if n != "direct")
                            + f" | upstream {row['mori']['upstream_cpu_us']:.0f} us "
                            "(during mori)", flush=True)
        if "smg" in targets:
            for line in against_targets([r for r in rows if r["api"] == "chat"]):
                print(line)
        if "before" in targets:
            for api in apis:
                for line in against_before([r for r in rows if r["api"] == api], args.cpu):
                    print(line if classic else f"{api:<12s} {line}")
        if not classic:
            for line in per_api(rows, apis):
                print(line)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    finally:
        stop(procs[::-1])


def measure(api: str, rnd: int, c: int, names: list[str], targets: dict[str, str],
            pids: dict[str, int], upstream_pid: int, scripts: dict[str, Path],
            paths: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """One row: ``api`` at ``c`` connections through each target of ``names`` (mori and
    before alternate which goes first, round by round)."""
    row: dict[str, Any] = {"round": rnd + 1, "connections": c, "api": api}
    order = list(names)
    if "before" in order and rnd % 2:  # alternate which of the two goes first
        i, j = order.index("mori"), order.index("before")
        order[i], order[j] = order[j], order[i]
    for name in order:
        if args.cpu:
            look = cpu_of(pids[name]), cpu_of(upstream_pid)
        row[name] = run_wrk(targets[name], c, args.seconds, scripts[api], paths[api])
        if args.cpu:
            n = row[name]["requests"]
            row[name]["cpu_us"] = cpu_per_request(look[0], cpu_of(pids[name]), n)
            row[name]["upstream_cpu_us"] = cpu_per_request(
                look[1], cpu_of(upstream_pid), n)["total"]
    for name in names:
        if name != "direct":
            row[f"{name}_added_p50_ms"] = (row[name]["p50_us"]
                                           - row["direct"]["p50_us"]) / 1e3
    return row


def per_api(rows: list[dict[str, Any]], apis: list[str]) -> list[str]:
    """Each API's figures at each connection count, the median over rounds: mori's p50,
    p99 and requests/s, direct's p50, the p50 mori adds, and that as a multiple of the
    chat path's added p50 in the same round (target: at most 1.2x)."""
    out = [f"{'api':<12s} {'c':>3s} {'mori p50':>9s} {'p99':>8s} {'req/s':>7s} "
           f"{'direct p50':>10s} {'added p50':>9s} {'x chat':>7s}  (ms; median of rounds)"]
    for c in dict.fromkeys(r["connections"] for r in rows):
        chat = {r["round"]: r for r in rows if r["connections"] == c and r["api"] == "chat"}
        for api in apis:
            at = [r for r in rows if r["connections"] == c and r["api"] == api]
            if not at:
                continue

            def med(f: Callable[[dict[str, Any]], float], at: list[dict[str, Any]] = at
                    ) -> float:
                return statistics.median(f(r) for r in at)

            line = (f"{api:<12s} {c:>3d} {med(lambda r: r['mori']['p50_us']) / 1e3:9.3f} "
                    f"{med(lambda r: r['mori']['p99_us']) / 1e3:8.3f} "
                    f"{med(lambda r: r['mori']['rps']):7.0f} "
                    f"{med(lambda r: r['direct']['p50_us']) / 1e3:10.3f} "
                    f"{med(lambda r: r['mori_added_p50_ms']):9.3f}")
            ratios = [r["mori_added_p50_ms"] / chat[r["round"]]["mori_added_p50_ms"]
                      for r in at if r["round"] in chat
                      and chat[r["round"]]["mori_added_p50_ms"] > 0]
            if api != "chat" and ratios:
                m = statistics.median(ratios)
                line += (f" {m:6.2f}x  ({'met' if m <= 1.2 else 'not met'}; rounds: "
                         + ", ".join(f"{v:.2f}" for v in ratios) + ")")
            out.append(line)
    return out


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
