"""MORI's disk tier on the real engine, through ``mori serve``: two-tier against three-tier.

    python bench/bench_vllm_disk.py [--programs 24] [--duration 3000] [--time-scale 100]
        [--blocks 128] [--cpu-blocks 256] [--disk-chunks 2560] [--rounds 2] [--json OUT]

Each round runs two arms, alternating, on fresh engines (vLLM's CPU build, the tiny model,
MORI's plug-in) behind ``mori serve``: ``two-tier``, a host tier of ``--cpu-blocks``
blocks; ``disk``, the same with MORI's disk tier of ``--disk-chunks`` one-block chunk files
(in a temporary directory) behind it. The same replay of the shipped traces goes through
each (``mori replay``, text prompts scaled to the engine as ``bench_vllm_agents.py`` scales
them). The table: steps (completed requests) per wall second, TTFT p50/p90 (policy
seconds), the requests the engine refused (prompts the replay's scaling made longer than
the model's window), and the shares of prompt tokens found on the GPU, loaded from the
host or disk tier (vLLM's external hits), and recomputed, from the engine's counters; and
the bytes read from the disk tier (``vllm:kv_offload_tiering_read_bytes_total``) and the
gateway's demotions to it. A tiny model on a CPU: a reload or a file read costs what it
costs here, not on a GPU server's NVMe; the figures compare the arms, no more.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.bench_vllm_agents import (  # noqa: E402
    Settings,
    engine_counters,
    max_output_tokens,
    policy_rates,
    replay_config,
    run_replay,
    tokens_per_text_token,
)
from bench.vllm_arms import (  # noqa: E402
    ArmFailed,
    Processes,
    block_bytes,
    http_get,
    start_engine,
    start_mori,
)
from mori.cli.table import format_table  # noqa: E402
from mori.replay.metrics import parse_prometheus  # noqa: E402
from mori.traces import default_traces  # noqa: E402

ARMS = ("two-tier", "disk")
DISK_READ = "vllm:kv_offload_tiering_read_bytes_total"
FILE_HEADER_BYTES = 56  # mori.vllm_plugin.disk_tier.HEADER.size (that module imports vLLM)


def _scrape(url: str, name: str, **labels: str) -> float:
    status, text = http_get(url + "/metrics", timeout=10.0)
    if status != 200:
        return 0.0
    return sum(v for lab, v in parse_prometheus(text).get(name, [])
               if all(lab.get(k) == want for k, want in labels.items()))


def run_arm(arm: str, s: Settings, disk_chunks: int, logs: Path) -> dict[str, Any]:
    traces = default_traces()
    procs = Processes()
    row: dict[str, Any] = {"arm": arm, "ok": False}
    try:
        with tempfile.TemporaryDirectory(prefix="mori-bench-disk-") as tmp:
            disk = None
            if arm == "disk":
                gib = disk_chunks * (block_bytes() + FILE_HEADER_BYTES) / (1 << 30)
                disk = (gib, Path(tmp))
            engine = start_engine(procs, logs, s.blocks, s.cpu_blocks, plugin=True, arm=arm,
                                  disk=disk)
            status, body = http_get(engine.url + "/v1/models")
            max_model_len = int(json.loads(body)["data"][0]["max_model_len"])
            ratio = tokens_per_text_token(engine.url)
            target, _ = start_mori(procs, logs, engine, s.time_scale, arm,
                                   policy_rates(s.time_scale))
            cfg = replay_config(target, s, ratio, max_model_len, max_output_tokens(traces))
            before, read0 = engine_counters(engine.url), _scrape(engine.url, DISK_READ)
            result = run_replay(cfg, traces, thunderagent=False)
            time.sleep(1.0)
            after, read1 = engine_counters(engine.url), _scrape(engine.url, DISK_READ)
            d = {k: after[k] - before[k] for k in ("prompt", "hits", "cpu_hits")}
            prompt = max(1.0, d["prompt"])
            row.update({
                "ok": True, "steps_per_s": result.steps / (s.duration_s / s.time_scale),
                "steps": result.steps, "requests": result.requests,
                "refused": result.error_count, "errors": result.errors,
                "ttft_p50_s": result.ttft_p50_s, "ttft_p90_s": result.ttft_p90_s,
                "prompt_tokens": int(d["prompt"]), "gpu_share": d["hits"] / prompt,
                "tier_share": d["cpu_hits"] / prompt,
                "recomputed_share": (d["prompt"] - d["hits"] - d["cpu_hits"]) / prompt,
                "disk_read_bytes": int(read1 - read0),
                "demotions_to_disk": result.demotions_to_disk or 0})
    except ArmFailed as e:
        row["error"] = str(e)
        print(f"{arm}: {e}", file=sys.stderr)
    finally:
        procs.stop()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        if not r["ok"]:
            out.append([r["arm"], str(r.get("round", "")), "failed", *[""] * 8])
            continue
        out.append([r["arm"], str(r["round"]), f"{r['steps_per_s']:.2f}",
                     f"{r['ttft_p50_s']:.1f}", f"{r['ttft_p90_s']:.1f}", str(r["refused"]),
                     f"{100 * r['gpu_share']:.1f}%", f"{100 * r['tier_share']:.1f}%",
                     f"{100 * r['recomputed_share']:.1f}%", f"{r['disk_read_bytes']:,}",
                     str(r["demotions_to_disk"])])
    return format_table(("arm", "round", "steps / s", "TTFT p50 (s)", "TTFT p90 (s)",
                         "refused", "GPU hits", "host/disk hits", "recomputed",
                         "disk read (B)", "demotions to disk"), out,
                        [False, True, True, True, True, True, True, True, True, True, True])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=24)
    ap.add_argument("--duration", type=float, default=3000.0, help="policy seconds")
    ap.add_argument("--time-scale", type=float, default=100.0)
    ap.add_argument("--token-scale", type=float, default=0.01,
                    help="engine tokens per trace token")
    ap.add_argument("--blocks", type=int, default=128, help="the engine's GPU pool, blocks")
    ap.add_argument("--cpu-blocks", type=int, default=256, help="the host tier, blocks")
    ap.add_argument("--disk-chunks", type=int, default=2560, help="the disk tier, chunks")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logs", type=Path, default=None, help="directory for the logs")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    s = Settings(programs=args.programs, duration_s=args.duration,
                 time_scale=args.time_scale, token_scale=args.token_scale,
                 blocks=args.blocks, seed=args.seed, cpu_blocks=args.cpu_blocks)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="mori-bench-disk-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    for rnd in range(1, args.rounds + 1):
        for arm in ARMS:
            print(f"round {rnd}: {arm}", file=sys.stderr)
            row = run_arm(arm, s, args.disk_chunks, logs)
            row["round"] = rnd
            rows.append(row)
    print(table(rows))
    ok = [r for r in rows if r["ok"]]
    for rnd in range(1, args.rounds + 1):
        pair = {r["arm"]: r for r in ok if r["round"] == rnd}
        if len(pair) == 2 and pair["two-tier"]["steps_per_s"] > 0:
            print(f"round {rnd}: disk / two-tier steps per second "
                  f"{pair['disk']['steps_per_s'] / pair['two-tier']['steps_per_s']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {
            "logs": str(logs), "json": str(args.json)}, "rows": rows}, indent=1, default=str))
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
