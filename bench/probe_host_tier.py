"""How much a vLLM host KV tier keeps: fresh tokens that may follow a prompt before the
engine loses it.

    python bench/probe_host_tier.py [--blocks 256] [--cpu-blocks 512] [--size 1000]
        [--after 6,8,10,12,14,15,16,17,18,20,24] [--engine-cpus auto] [--json FILE]

Starts the CPU engine as the real-engine benchmark does (``scripts/start_vllm_cpu.sh``,
the tiny random-weight model, ``--blocks`` GPU blocks of 32 tokens, vLLM's offloading
connector with a host tier of ``--cpu-blocks`` blocks, plain LRU, no MORI plug-in). For
each k of ``--after``: one fresh prompt P of about ``--size`` tokens, then k fresh prompts
of the same size, then P again; the engine's prefix-cache counters say how many of P's
tokens came back from the GPU pool and from the host tier. Requests go one at a time,
``max_tokens`` 1.

What it measures is the simulator's model of a write-through host tier
(``mori.sim.kvcache``): the host tier keeps the last ``--cpu-blocks`` x 32 tokens
computed, whatever the GPU pool holds, so P comes back whole while k x size stays under
it, in part around it (LRU evicts a program's tail first), and not beyond. The GPU pool
keeps P only while the fresh prompts fit beside it.

Needs the vLLM CPU venv and the tiny model (``scripts/vllm_cpu_env.sh``,
``scripts/make_tiny_model.py``); about two minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.bench_vllm_agents import engine_counters, split_cpus  # noqa: E402
from bench.calibrate_cpu_engine import Prompts, post, start_engine  # noqa: E402
from bench.vllm_arms import BLOCK_SIZE, block_bytes, stop_group  # noqa: E402
from mori.cli.table import format_table  # noqa: E402


def probe(url: str, prompts: Prompts, size: int, after: list[int]) -> list[dict[str, Any]]:
    rows = []
    for k in after:
        body = {"model": "tiny", "prompt": prompts.of(size), "max_tokens": 1,
                "temperature": 0}
        tokens = int(post(url + "/v1/completions", body)["usage"]["prompt_tokens"])
        fresh = 0
        for _ in range(k):
            out = post(url + "/v1/completions", {**body, "prompt": prompts.of(size)})
            fresh += int(out["usage"]["prompt_tokens"])
        before = engine_counters(url)
        post(url + "/v1/completions", body)
        later = engine_counters(url)
        rows.append({"after": k, "fresh_tokens": fresh, "prompt_tokens": tokens,
                     "gpu_hit": int(later["hits"] - before["hits"]),
                     "host_hit": int(later["cpu_hits"] - before["cpu_hits"])})
        print(f"after {k} prompts ({fresh:,} fresh tokens): {rows[-1]['gpu_hit']} from the "
              f"GPU, {rows[-1]['host_hit']} from the host tier, of {tokens}",
              file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=256, help="GPU blocks (default: 256)")
    ap.add_argument("--cpu-blocks", type=int, default=512,
                    help="host-tier blocks (default: 512)")
    ap.add_argument("--size", type=int, default=1000, help="tokens a prompt (default: 1000)")
    ap.add_argument("--after", default="6,8,10,12,14,15,16,17,18,20,24",
                    help="fresh prompts between P and its return, comma-separated")
    ap.add_argument("--engine-cpus", default="auto",
                    help="CPUs of the engine, as the benchmark's option (default: auto)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        after = [int(x) for x in args.after.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--after takes whole numbers, comma-separated (got {args.after!r})")
    if args.blocks < 8 or args.cpu_blocks < 1 or args.size < 64 or not after or \
            min(after) < 0:
        ap.error("--blocks >= 8, --cpu-blocks >= 1, --size >= 64 and --after >= 0, please")
    engine_cpus, _ = split_cpus(args.engine_cpus)
    cpu_gib = args.cpu_blocks * block_bytes() / 2**30
    log = Path(tempfile.mkdtemp(prefix="probe-host-tier-")) / "vllm.log"
    proc, url = start_engine(args.blocks, log, cpu_gib=cpu_gib, cpus=engine_cpus)
    try:
        rows = probe(url, Prompts(url), args.size, after)
    finally:
        stop_group(proc)
    host = args.cpu_blocks * BLOCK_SIZE
    print(f"\nhost tier {args.cpu_blocks} blocks ({host:,} tokens), GPU pool "
          f"{args.blocks} blocks; P about {args.size} tokens\n")
    print(format_table(["fresh prompts", "fresh tokens", "P from the GPU",
                        "P from the host tier", "P tokens"],
                       [[str(r["after"]), f"{r['fresh_tokens']:,}", str(r["gpu_hit"]),
                         str(r["host_hit"]), str(r["prompt_tokens"])] for r in rows]))
    if args.json:
        args.json.write_text(json.dumps({"blocks": args.blocks, "cpu_blocks": args.cpu_blocks,
                                         "size": args.size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
