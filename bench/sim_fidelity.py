"""How close the simulator comes to the real vLLM CPU engine: the prefix-cached share.

    python bench/sim_fidelity.py BENCH.json [--traces PATH] [--json OUT]

``BENCH.json`` is what ``python bench/bench_vllm_agents.py --json FILE`` wrote: its
``settings`` (programs, duration, time and token scales, engine blocks, host-tier blocks,
seed, trace set) and one row per arm with the engine's own token counters. Each arm that
the simulator can model is simulated with the same workload on the ``cpu-tiny-llama``
preset (the tiny model on vLLM's CPU build): the same programs, duration, seed, trace
set, context cut (the arm's ``max_context``, trace tokens), token scale and time scale,
and the engine's pool of ``(blocks - 1) x 32`` tokens (vLLM keeps one block aside):

  a  vLLM direct (LRU)       -> policy ``smg`` with no host tier (``--cpu-blocks 0``);
                                with one, ``lru-offload``: the engine's write-through host
                                tier, evicted LRU, of ``cpu_blocks x 32`` tokens less the
                                GPU pool
  d  MORI + vLLM plug-in     -> policy ``mori``, CPU tier of ``cpu_blocks x 32`` tokens
                                less the GPU pool (the host tier is write-through: it also
                                mirrors the GPU; the gateway's vLLM adapter sizes it so)

The table compares the cached share of prompt tokens, real ((GPU hits + host-tier hits) /
prompt tokens, from vLLM's counters) against simulated (GPU hits + CPU-tier reloads, /
prompt tokens), and the requests completed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mori.cli.table import format_table  # noqa: E402
from mori.sim.config import SimConfig  # noqa: E402
from mori.sim.metrics import RunResult  # noqa: E402
from mori.sim.runner import simulate  # noqa: E402
from mori.traces import TraceSet, default_traces, load_traces  # noqa: E402

PRESET = "cpu-tiny-llama"
ARM_POLICY = {"a": "smg", "d": "mori"}
"""The simulator policy that models each bench arm (arm (a) with a host tier:
``lru-offload``, see ``arm_policy``)."""
WITHIN_PP = 10.0
"""A simulated cached share within this many percentage points of the real one agrees."""
DEFAULT_BLOCK_SIZE = 32


@dataclass(frozen=True)
class Fidelity:
    """The comparison rows (one per modelled arm that ran) and notes on what was left out."""

    rows: list[dict[str, Any]]
    notes: list[str]


def arm_policy(name: str, settings: dict[str, Any]) -> str:
    """The policy that models arm ``name`` of a bench run with ``settings``."""
    if name == "a" and int(settings.get("cpu_blocks", 0)) > 0:
        return "lru-offload"  # vLLM's own offloading: write-through, LRU
    return ARM_POLICY[name]


def sim_config(settings: dict[str, Any], arm: dict[str, Any], policy: str) -> SimConfig:
    """The simulation of one bench arm: its workload and the engine's pools."""
    block = int(settings.get("block_size", DEFAULT_BLOCK_SIZE))
    gpu = (int(settings["blocks"]) - 1) * block  # vLLM keeps one block aside
    # the host tier is write-through: the policy's CPU tier is what it holds beyond the
    # GPU pool's mirror, as the gateway's vLLM adapter sizes it
    cpu = max(0, int(settings.get("cpu_blocks", 0)) * block - gpu)
    return SimConfig(
        policy=policy, programs=int(settings["programs"]), hardware=PRESET,
        duration_s=float(settings["duration_s"]), seed=int(settings["seed"]),
        max_context=int(arm["max_context"]), gpu_kv_tokens=gpu,
        cpu_kv_tokens=cpu if policy != "smg" else 0,  # smg: an engine without a host tier
        token_scale=float(settings["token_scale"]), time_scale=float(settings["time_scale"]))


def real_cached_share(arm: dict[str, Any]) -> float | None:
    """(GPU + host-tier prefix hits) / prompt tokens, from the engine's counters."""
    prompt = int(arm["prompt_tokens"])
    if prompt <= 0:
        return None
    return (int(arm["cached_tokens_gpu"]) + int(arm["cached_tokens_cpu"])) / prompt


def compare_arm(settings: dict[str, Any], arm: dict[str, Any], traces: TraceSet
                ) -> dict[str, Any]:
    """One comparison row: the real arm's figures next to its simulation's."""
    policy = arm_policy(arm["arm"], settings)
    result: RunResult = simulate(sim_config(settings, arm, policy), traces)
    real = real_cached_share(arm)
    sim = result.gpu_hit_rate + result.cpu_hit_rate
    diff_pp = None if real is None else 100.0 * (sim - real)
    return {
        "arm": arm["arm"], "name": arm.get("name", ""), "sim_policy": policy,
        "real_prompt_tokens": int(arm["prompt_tokens"]),
        "real_cached_share": real,
        "real_cached_share_gpu": (int(arm["cached_tokens_gpu"]) / int(arm["prompt_tokens"])
                                  if real is not None else None),
        "real_cached_share_cpu": (int(arm["cached_tokens_cpu"]) / int(arm["prompt_tokens"])
                                  if real is not None else None),
        "sim_prompt_tokens": result.prompt_tokens,
        "sim_cached_share": sim,
        "sim_cached_share_gpu": result.gpu_hit_rate,
        "sim_cached_share_cpu": result.cpu_hit_rate,
        "diff_pp": diff_pp,
        "within": None if diff_pp is None else abs(diff_pp) <= WITHIN_PP,
        "real_requests_completed": arm.get("requests_completed"),
        "sim_requests_completed": result.steps,
        "sim_gpu_kv_tokens": result.gpu_kv_capacity_tokens,
        "sim_cpu_kv_tokens": result.cpu_kv_capacity_tokens,
        "max_context": result.max_context,
    }


def fidelity(doc: dict[str, Any], traces: TraceSet) -> Fidelity:
    """Simulate every arm of ``doc`` (a bench JSON) the simulator models and compare."""
    settings = doc["settings"]
    rows, notes = [], []
    if settings.get("traces") not in (None, traces.name):
        notes.append(f"the bench replayed trace set {settings['traces']!r}, the simulation "
                     f"{traces.name!r}: pass --traces")
    for arm in doc["arms"]:
        name = arm.get("arm")
        if name not in ARM_POLICY:
            notes.append(f"arm ({name}) is not modelled by the simulator; skipped")
            continue
        if not arm.get("ok"):
            notes.append(f"arm ({name}) failed in the bench; skipped")
            continue
        rows.append(compare_arm(settings, arm, traces))
    return Fidelity(rows, notes)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a text table."""
    headers = ("arm", "sim policy", "real cached", "(GPU / CPU)", "sim cached", "(GPU / CPU)",
               "diff (pp)", f"within {WITHIN_PP:g} pp", "requests real", "requests sim")
    out = []
    for r in rows:
        diff = "-" if r["diff_pp"] is None else f"{r['diff_pp']:+.1f}"
        within = "-" if r["within"] is None else ("yes" if r["within"] else "no")
        real_req = r["real_requests_completed"]
        out.append([
            f"({r['arm']}) {r['name']}".strip(), r["sim_policy"], _pct(r["real_cached_share"]),
            f"{_pct(r['real_cached_share_gpu'])} / {_pct(r['real_cached_share_cpu'])}",
            _pct(r["sim_cached_share"]),
            f"{_pct(r['sim_cached_share_gpu'])} / {_pct(r['sim_cached_share_cpu'])}",
            diff, within, "-" if real_req is None else str(real_req),
            str(r["sim_requests_completed"])])
    right = [False, False] + [True] * (len(headers) - 2)
    return format_table(headers, out, right)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", type=Path,
                    help="the file `bench/bench_vllm_agents.py --json FILE` wrote")
    ap.add_argument("--traces", type=Path, default=None,
                    help="the trace set the bench replayed (default: the shipped one)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.bench_json.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"sim_fidelity: cannot read {args.bench_json}: {e}", file=sys.stderr)
        return 2
    traces = load_traces(args.traces) if args.traces else default_traces()
    report = fidelity(doc, traces)
    s = doc["settings"]
    print(f"{s['programs']} programs of {traces.name!r}, {s['duration_s']:g} s at time scale "
          f"{s['time_scale']:g}, token scale {s['token_scale']:g}, {s['blocks']} blocks, host "
          f"tier {s.get('cpu_blocks', 0)} blocks; simulated on {PRESET}")
    print(table(report.rows) if report.rows else "no arm to compare")
    for note in report.notes:
        print(f"note: {note}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": report.rows, "notes": report.notes},
                                        indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
