"""The same agentic trace set through Dynamo's frontend with three routers on the same
mocker fleet: MORI's (``mori dynamo-router``), Dynamo's ThunderAgent router and Dynamo's
KV router.

    python bench/bench_dynamo.py --programs 16 --steps 6 --json out.json

Each router gets a fresh fleet (``bench/dynamo_fleet.py``: the frontend, ``--workers``
mocker workers with ``--gpu-blocks`` GPU and ``--host-blocks`` host KV blocks, the
router) from the venv of ``scripts/dynamo_cpu_env.sh``. Every program replays the first
``--steps`` steps of a trace (``--traces``: a file, or the shipped default set) closed
loop: its prompt is its context (the trace's tokens divided by ``--token-scale``, as
text that extends the previous turn's, so the engine can reuse its prefix), it asks for
the step's output tokens (scaled, at most ``--max-output``), then waits the step's tool
time divided by ``--time-scale`` before its next turn; after its last turn, the MORI and
ThunderAgent arms send ``x-dynamo-session-final``. Programs start ``--stagger`` seconds
apart. Reported per router: the time to finish every program, turns per second, the
turns' latency (mean, p90), the share of prompt tokens the engine served from its cache
(``cached_tokens``), the errors (a turn not answered within ``--turn-timeout`` is
retried, five times at most) and the programs abandoned after five failures.

The mocker simulates an engine's KV cache, batching and timing without a model; the
figures compare routers on one machine's CPUs, not GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
    turns: int = 0
    errors: int = 0
    abandoned: int = 0
    makespan_s: float = 0.0
    turns_per_s: float = 0.0
    latency_mean_s: float = 0.0
    latency_p90_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_share: float = 0.0
    fleet_start_s: float = 0.0
    error_samples: list[str] = field(default_factory=list)


def plan(programs: list[ProgramTrace], steps: int, token_scale: float, time_scale: float,
         max_tokens: int, max_output: int) -> dict[str, list[Turn]]:
    """Each program's turns: context and output tokens scaled (a context never shrinks,
    and fits ``max_tokens``), tool time scaled."""
    out: dict[str, list[Turn]] = {}
    for i, p in enumerate(programs):
        name = f"p{i:03d}"
        turns, ctx = [], 0
        for s in p.steps[:steps]:
            ctx = min(max_tokens, max(ctx + 16, int(s.prompt_tokens / token_scale)))
            out_tokens = max(1, min(max_output, int(s.output_tokens / token_scale * 4)))
            turns.append(Turn(name, ctx, out_tokens, s.gap_s / time_scale))
        out[name] = turns
    return out


async def run_program(session: aiohttp.ClientSession, url: str, turns: list[Turn],
                      start_s: float, final: bool, res: ArmResult,
                      latencies: list[float]) -> None:
    await asyncio.sleep(start_s)
    headers = {"x-dynamo-session-id": turns[0].program}
    for t in turns:
        body = {"model": MODEL, "messages": [{"role": "user",
                                              "content": words(t.tokens, t.program)}],
                "max_tokens": t.output}
        t0 = time.monotonic()
        for _attempt in range(5):
            try:
                async with session.post(url + "/v1/chat/completions", json=body,
                                        headers=headers) as r:
                    data: Any = await r.json(content_type=None)
                    if r.status == 200:
                        break
                    why = f"{r.status}: {str(data)[:200]}"
            except TimeoutError:
                why = f"no answer within {session.timeout.total:g} s"
            res.errors += 1
            if len(res.error_samples) < 5:
                res.error_samples.append(f"{turns[0].program}: {why}")
            await asyncio.sleep(0.5)
        else:
            res.abandoned += 1  # the program gives up: its remaining turns are not run
            return
        latencies.append(time.monotonic() - t0)
        res.turns += 1
        usage = data.get("usage") or {}
        res.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        res.cached_tokens += int((usage.get("prompt_tokens_details") or {})
                                 .get("cached_tokens") or 0)
        await asyncio.sleep(t.gap_s)
    if final:
        async with session.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "done"}],
                "max_tokens": 1}, headers={**headers, "x-dynamo-session-final": "true"}):
            pass


async def drive(url: str, router: str, turns: dict[str, list[Turn]], stagger_s: float,
                res: ArmResult, turn_timeout_s: float) -> None:
    latencies: list[float] = []
    timeout = aiohttp.ClientTimeout(total=turn_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.monotonic()
        await asyncio.gather(*(run_program(session, url, ts, i * stagger_s, router != "kv",
                                           res, latencies)
                               for i, ts in enumerate(turns.values())))
        res.makespan_s = time.monotonic() - t0
    if latencies:
        res.latency_mean_s = statistics.fmean(latencies)
        res.latency_p90_s = sorted(latencies)[int(0.9 * (len(latencies) - 1))]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default=",".join(ROUTERS),
                    help="comma-separated, of: " + ", ".join(ROUTERS))
    ap.add_argument("--traces", default=None, help="a trace file (default: the shipped set)")
    ap.add_argument("--programs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6, help="steps replayed per program")
    ap.add_argument("--token-scale", type=float, default=50.0,
                    help="trace tokens per replayed token")
    ap.add_argument("--time-scale", type=float, default=20.0,
                    help="trace tool seconds per replayed second")
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--stagger", type=float, default=0.2, help="seconds between starts")
    ap.add_argument("--turn-timeout", type=float, default=30.0,
                    help="seconds a turn may take before it is retried (5 tries, then the "
                         "program is abandoned)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--gpu-blocks", type=int, default=256)
    ap.add_argument("--host-blocks", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--speedup", type=float, default=10.0, help="the mocker's speedup ratio")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        ap.error(f"unknown router(s) {bad}; choose from {', '.join(ROUTERS)}")
    traces = load_traces(args.traces) if args.traces else default_traces()
    progs = list(traces.programs)
    chosen = [progs[i % len(progs)] for i in range(args.programs)]
    shape = WorkerShape(args.gpu_blocks, args.host_blocks, args.block_size, args.speedup)
    gpu_tokens = args.gpu_blocks * args.block_size
    turns = plan(chosen, args.steps, args.token_scale, args.time_scale,
                 int(gpu_tokens * 0.9) - args.max_output, args.max_output)
    venv = venv_path()
    tokenizer = tokenizer_path(venv)
    results = []
    for router in routers:
        res = ArmResult(router, len(turns))
        with tempfile.TemporaryDirectory(prefix=f"mori-dynamo-{router}-") as folder:
            fleet = DynamoFleet(venv, tokenizer, Path(folder), MODEL, router, shape)
            try:
                res.fleet_start_s = fleet.start_fleet(args.workers)
                asyncio.run(drive(fleet.url, router, turns, args.stagger, res,
                                  args.turn_timeout))
            except FleetError as e:
                sys.exit(str(e))
            finally:
                fleet.stop()
        results.append(res)
        print(f"{router:13s} {res.makespan_s:7.1f} s  {res.turns_per_s:6.2f} turns/s  "
              f"latency {res.latency_mean_s:6.3f} s (p90 {res.latency_p90_s:6.3f})  cached "
              f"{res.cached_share:6.1%}  errors {res.errors}  abandoned {res.abandoned}", flush=True)
        for sample in res.error_samples:
            print(f"    {sample}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": [asdict(r) for r in results]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
