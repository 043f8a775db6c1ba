"""The same agentic trace set through Dynamo's frontend with three routers on the same
mocker fleet: MORI's (``mori dynamo-router``), Dynamo's ThunderAgent router and Dynamo's
KV router, over host tier sizes, in rounds.

    python bench/bench_dynamo.py --host-ratio 0,0.25,1,2 --speedup 1 --rounds 3 --json out.json

Each run is a fresh fleet (``bench/dynamo_fleet.py``: the frontend, ``--workers`` mocker
workers with ``--gpu-blocks`` GPU KV blocks and ``ratio x --gpu-blocks`` host blocks for
each ``--host-ratio``, the router) from the venv of ``scripts/dynamo_cpu_env.sh``; in
each host size, ``--rounds`` rounds of every router, the order rotated each round.
Every program replays the first ``--steps`` steps of a trace (``--traces``: a file, or
the shipped default set) closed loop: its prompt is its context (the trace's tokens
divided by ``--token-scale``, at most ``--context-cap`` of one worker's GPU KV, as text
that extends the previous turn's, so the engine can reuse its prefix), it asks for the
step's output tokens (scaled, at most ``--max-output``), streamed, then waits the step's
tool time divided by ``--time-scale`` (at most ``--max-gap``) before its next turn; after
its last turn, the MORI and ThunderAgent arms send ``x-dynamo-session-final``. Programs
start ``--stagger`` seconds apart. Reported per run, and per host size and router as the
median over rounds: steps (turns) completed per second, TTFT p50/p90 (the first streamed
chunk), the share of prompt tokens the engine served from its cache (``cached_tokens``),
the errors (a turn not answered within ``--turn-timeout`` is retried, five times at
most) and the programs abandoned after five failures; and the MORI router's steps per
second over ThunderAgent's and over the KV router's. ``--mori-report`` also asks the
MORI router for its report on each turn: the turns it held, for how long, per replica.

The mocker simulates an engine's KV cache, batching and timing without a model (it
streams no text: TTFT is the time to the role chunk); the figures compare routers on
one machine's CPUs, not GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.dynamo_fleet import ROOT, ROUTERS, DynamoFleet, FleetError, WorkerShape, words
from mori.traces import default_traces, load_traces
from mori.traces.model import ProgramTrace

MODEL = "agent"


@dataclass
class Turn:
    program: str
    tokens: int
    output: int
    gap_s: float


@dataclass
class ArmResult:
    router: str
    programs: int
    host_ratio: float = 0.0
    round: int = 0
    turns: int = 0
    errors: int = 0
    abandoned: int = 0
    makespan_s: float = 0.0
    turns_per_s: float = 0.0
    latency_mean_s: float = 0.0
    latency_p90_s: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_share: float = 0.0
    fleet_start_s: float = 0.0
    held_turns: int = 0  # the MORI router's turns it held (with --mori-report)
    held_s: float = 0.0
    replica_turns: dict[str, int] = field(default_factory=dict)  # turns, prompt tokens
    replica_tokens: dict[str, int] = field(default_factory=dict)  # per MORI replica
    error_samples: list[str] = field(default_factory=list)


def plan(programs: list[ProgramTrace], steps: int, token_scale: float, time_scale: float,
         max_tokens: int, max_output: int, max_gap_s: float = float("inf")
         ) -> dict[str, list[Turn]]:
    """Each program's turns: context and output tokens scaled (a context never shrinks,
    and fits ``max_tokens``), tool time scaled (and at most ``max_gap_s``)."""
    out: dict[str, list[Turn]] = {}
    for i, p in enumerate(programs):
        name = f"p{i:03d}"
        turns, ctx = [], 0
        for s in p.steps[:steps]:
            ctx = min(max_tokens, max(ctx + 16, int(s.prompt_tokens / token_scale)))
            out_tokens = max(1, min(max_output, int(s.output_tokens / token_scale * 4)))
            turns.append(Turn(name, ctx, out_tokens, min(max_gap_s, s.gap_s / time_scale)))
        out[name] = turns
    return out


async def one_turn(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   headers: dict[str, str]) -> tuple[int, float, dict[str, Any], str]:
    """One streamed turn: the status, the seconds to its first chunk, the usage of its last
    chunk, and what went wrong (empty when nothing did)."""
    t0 = time.monotonic()
    ttft = -1.0
    usage: dict[str, Any] = {}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            return r.status, ttft, usage, f"{r.status}: {(await r.text())[:200]}"
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            if ttft < 0:
                ttft = time.monotonic() - t0
            try:
                chunk = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(chunk, dict) and chunk.get("usage"):
                usage = {**usage, **chunk["usage"]}
            mori = ((chunk.get("nvext") or {}).get("engine_data") or {}).get("mori") \
                if isinstance(chunk, dict) else None
            if isinstance(mori, dict):
                usage = {**usage, "mori_held_s": float(mori.get("held_s") or 0.0),
                         "mori_replica": int(mori.get("replica") or 0)}
            if isinstance(chunk, dict) and "error" in chunk:
                return 500, ttft, usage, str(chunk["error"])[:200]
    return 200, ttft, usage, ""


async def run_program(session: aiohttp.ClientSession, url: str, turns: list[Turn],
                      start_s: float, final: bool, res: ArmResult,
                      latencies: list[float], ttfts: list[float],
                      report: bool = False) -> None:
    await asyncio.sleep(start_s)
    headers = {"x-dynamo-session-id": turns[0].program}
    for t in turns:
        body = {"model": MODEL, "messages": [{"role": "user",
                                              "content": words(t.tokens, t.program)}],
                "max_tokens": t.output, "stream": True,
                "stream_options": {"include_usage": True},
                **({"nvext": {"extra_fields": ["engine_data"]}} if report else {})}
        t0 = time.monotonic()
        for _attempt in range(5):
            try:
                status, ttft, usage, why = await one_turn(session, url, body, headers)
                if status == 200:
                    break
            except TimeoutError:
                why = f"no answer within {session.timeout.total:g} s"
            except aiohttp.ClientError as e:
                why = f"{type(e).__name__}: {e}"[:200]
            res.errors += 1
            if len(res.error_samples) < 5:
                res.error_samples.append(f"{turns[0].program}: {why}")
            await asyncio.sleep(0.5)
        else:
            res.abandoned += 1  # the program gives up: its remaining turns are not run
            return
        latencies.append(time.monotonic() - t0)
        if ttft >= 0:
            ttfts.append(ttft)
        res.turns += 1
        if "mori_replica" in usage:
            slot = str(usage["mori_replica"])
            res.replica_turns[slot] = res.replica_turns.get(slot, 0) + 1
            res.replica_tokens[slot] = (res.replica_tokens.get(slot, 0)
                                        + int(usage.get("prompt_tokens") or 0))
        if usage.get("mori_held_s"):
            res.held_turns += 1
            res.held_s += usage["mori_held_s"]
        res.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        res.cached_tokens += int((usage.get("prompt_tokens_details") or {})
                                 .get("cached_tokens") or 0)
        await asyncio.sleep(t.gap_s)
    if final:
        async with session.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "done"}],
                "max_tokens": 1}, headers={**headers, "x-dynamo-session-final": "true"}):
            pass


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank below; 0 for none)."""
    return sorted(xs)[int(q * (len(xs) - 1))] if xs else 0.0


async def drive(url: str, router: str, turns: dict[str, list[Turn]], stagger_s: float,
                res: ArmResult, turn_timeout_s: float, report: bool = False) -> None:
    latencies: list[float] = []
    ttfts: list[float] = []
    timeout = aiohttp.ClientTimeout(total=turn_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(run_program(session, url, ts, i * stagger_s, router != "kv",
                                           res, latencies, ttfts,
                                           report and router == "mori")
                               for i, ts in enumerate(turns.values())))
        res.makespan_s = time.monotonic() - t0
    if latencies:
        res.latency_mean_s = statistics.fmean(latencies)
        res.latency_p90_s = pct(latencies, 0.9)
    res.ttft_p50_s, res.ttft_p90_s = pct(ttfts, 0.5), pct(ttfts, 0.9)
    res.turns_per_s = res.turns / res.makespan_s if res.makespan_s else 0.0
    res.cached_share = res.cached_tokens / res.prompt_tokens if res.prompt_tokens else 0.0


def venv_path() -> Path:
    import subprocess

    proc = subprocess.run(["bash", str(ROOT / "scripts" / "dynamo_cpu_env.sh")],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"scripts/dynamo_cpu_env.sh failed (exit {proc.returncode}):\n"
                 f"{proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def tokenizer_path(venv: Path) -> Path:
    import subprocess

    out = Path.home() / ".cache" / "mori" / "tiny-llama-tokenizer"
    subprocess.run([str(venv / "bin" / "python"), str(ROOT / "scripts" / "make_tiny_model.py"),
                    str(out), "--no-weights"], capture_output=True, check=True)
    return out


def schedule(routers: list[str], ratios: list[float], rounds: int
             ) -> list[tuple[float, int, str]]:
    """The runs, in order: for each host ratio, ``rounds`` rounds of every router, the
    order rotated by one each round (mori, thunderagent, kv; thunderagent, kv, mori; ...)
    so that no router always runs first or last in a cell."""
    out = []
    for ratio in ratios:
        for r in range(rounds):
            k = r % len(routers)
            out += [(ratio, r + 1, router) for router in routers[k:] + routers[:k]]
    return out


METRICS = ("turns_per_s", "ttft_p50_s", "ttft_p90_s", "cached_share", "errors", "abandoned")


def summarize(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Per (host ratio, router): the median over rounds of each metric, and the MORI
    router's steps per second over ThunderAgent's and over the KV router's."""
    cells: dict[tuple[float, str], list[ArmResult]] = {}
    for r in results:
        cells.setdefault((r.host_ratio, r.router), []).append(r)
    rows = [{"host_ratio": ratio, "router": router, "rounds": len(rs),
             **{m: statistics.median(getattr(r, m) for r in rs) for m in METRICS}}
            for (ratio, router), rs in cells.items()]
    tps = {(row["host_ratio"], row["router"]): row["turns_per_s"] for row in rows}
    for row in rows:
        if row["router"] == "mori":
            for other in ("thunderagent", "kv"):
                base = tps.get((row["host_ratio"], other))
                row[f"x_{other}"] = row["turns_per_s"] / base if base else None
    return sorted(rows, key=lambda row: (row["host_ratio"], ROUTERS.index(row["router"])))


NAMES = {"mori": "MORI", "thunderagent": "ThunderAgent", "kv": "KV"}


def table(rows: list[dict[str, Any]]) -> str:
    def ratio(x: Any) -> str:
        return "" if x is None else f"{x:.2f}x"
    lines = ["| host tier (x GPU) | router | steps/s | TTFT p50 | TTFT p90 | cached share "
             "| errors / abandoned | MORI / ThunderAgent | MORI / KV |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(
            f"| {row['host_ratio']:g} | {NAMES[row['router']]} | {row['turns_per_s']:.2f} "
            f"| {row['ttft_p50_s'] * 1000:.0f} ms | {row['ttft_p90_s'] * 1000:.0f} ms "
            f"| {row['cached_share']:.1%} | {row['errors']:g} / {row['abandoned']:g} "
            f"| {ratio(row.get('x_thunderagent'))} | {ratio(row.get('x_kv'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default=",".join(ROUTERS),
                    help="comma-separated, of: " + ", ".join(ROUTERS))
    ap.add_argument("--traces", default=None, help="a trace file (default: the shipped set)")
    ap.add_argument("--programs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6, help="steps replayed per program")
    ap.add_argument("--token-scale", type=float, default=200.0,
                    help="trace tokens per replayed token")
    ap.add_argument("--time-scale", type=float, default=100.0,
                    help="trace tool seconds per replayed second")
    ap.add_argument("--max-gap", type=float, default=1.0,
                    help="the longest replayed tool call, seconds (so that the longest "
                         "program's tools do not set the time to finish)")
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--context-cap", type=float, default=0.25,
                    help="the largest context, as a share of one worker's GPU KV")
    ap.add_argument("--stagger", type=float, default=0.1, help="seconds between starts")
    ap.add_argument("--turn-timeout", type=float, default=60.0,
                    help="seconds a turn may take before it is retried (5 tries, then the "
                         "program is abandoned)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu-blocks", type=int, default=128)
    ap.add_argument("--host-ratio", default="1",
                    help="comma-separated host tier sizes as multiples of --gpu-blocks "
                         "(each worker's --num-host-blocks = ratio x --gpu-blocks)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds per host ratio, the routers' order rotated each round")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--speedup", type=float, default=10.0, help="the mocker's speedup ratio")
    ap.add_argument("--thunderagent-args", default="--scheduler-interval-seconds 0.5",
                    help="extra flags for dynamo.thunderagent_router (its scheduler runs "
                         "every 5 s by default; the replay's tool time is scaled down)")
    ap.add_argument("--mori-args", default="", help="extra flags for mori dynamo-router")
    ap.add_argument("--mori-report", action="store_true",
                    help="ask the MORI router for its report on each turn (engine_data) and "
                         "count the turns it held and for how long (it also reads each "
                         "prompt's overlap, a cost the other arms do not have)")
    ap.add_argument("--logs", type=Path, default=None,
                    help="keep each run's process logs under this folder")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        ap.error(f"unknown router(s) {bad}; choose from {', '.join(ROUTERS)}")
    ratios = [float(x) for x in args.host_ratio.split(",") if x.strip()]
    traces = load_traces(args.traces) if args.traces else default_traces()
    progs = list(traces.programs)
    chosen = [progs[i % len(progs)] for i in range(args.programs)]
    gpu_tokens = args.gpu_blocks * args.block_size
    turns = plan(chosen, args.steps, args.token_scale, args.time_scale,
                 int(gpu_tokens * args.context_cap), args.max_output, args.max_gap)
    demand = sum(max(t.tokens for t in ts) for ts in turns.values())
    print(f"{len(turns)} programs, {sum(map(len, turns.values()))} turns; their largest "
          f"contexts add up to {demand} tokens = {demand / (gpu_tokens * args.workers):.1f}x "
          f"the fleet's GPU KV ({args.workers} x {gpu_tokens})", flush=True)
    extra = {"mori": tuple(shlex.split(args.mori_args)),
             "thunderagent": tuple(shlex.split(args.thunderagent_args)), "kv": ()}
    venv = venv_path()
    tokenizer = tokenizer_path(venv)
    results = []
    for ratio, rnd, router in schedule(routers, ratios, args.rounds):
        shape = WorkerShape(args.gpu_blocks, round(ratio * args.gpu_blocks), args.block_size,
                            args.speedup)
        res = ArmResult(router, len(turns), ratio, rnd)
        with tempfile.TemporaryDirectory(prefix=f"mori-dynamo-{router}-") as folder:
            fleet = DynamoFleet(venv, tokenizer, Path(folder), MODEL, router, shape,
                                extra[router])
            try:
                res.fleet_start_s = fleet.start_fleet(args.workers)
                asyncio.run(drive(fleet.url, router, turns, args.stagger, res,
                                  args.turn_timeout, args.mori_report))
            except FleetError as e:
                sys.exit(str(e))
            finally:
                fleet.stop()
                if args.logs is not None:
                    keep = args.logs / f"host{ratio:g}-round{rnd}-{router}"
                    shutil.copytree(folder, keep, dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("discovery"))
        results.append(res)
        print(f"host {ratio:4g}x round {rnd} {router:13s} {res.makespan_s:6.1f} s "
              f"{res.turns_per_s:6.2f} steps/s  TTFT p50 {res.ttft_p50_s * 1000:5.0f} ms "
              f"p90 {res.ttft_p90_s * 1000:5.0f} ms  cached {res.cached_share:6.1%}  "
              f"errors {res.errors}  abandoned {res.abandoned}  (fleet start "
              f"{res.fleet_start_s:.1f} s)"
              + (f"  held {res.held_turns} turns ({res.held_s:.1f} s), turns (prompt tokens) "
                 f"per replica: " + ", ".join(f"{k}: {v} ({res.replica_tokens[k]})" for k, v in
                                              sorted(res.replica_turns.items()))
                 if res.replica_turns else ""),
              flush=True)
        for sample in res.error_samples:
            print(f"    {sample}", flush=True)
    rows = summarize(results)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "summary": rows,
                                         "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
