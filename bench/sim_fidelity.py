"""How close the simulator comes to the real vLLM CPU engine: the prefix-cached share.

    python bench/sim_fidelity.py BENCH.json [--traces PATH] [--calibration FILE] [--json OUT]

``BENCH.json`` is what ``python bench/bench_vllm_agents.py --json FILE`` wrote: its
``settings`` (programs, duration, time and token scales, engine blocks, host-tier blocks,
seed, trace set) and one row per arm with the engine's own token counters. Each arm that
the simulator can model is simulated with the same workload on the ``cpu-tiny-llama``
preset (the tiny model on vLLM's CPU build): the same programs, duration, seed, trace
set, context cut (the arm's ``max_context``, trace tokens), token scale, the replay's time
scale as the engine's slowdown (``SimConfig.engine_slowdown``), and the engine's pool
of ``(blocks - 1) x 32`` tokens (vLLM keeps one block aside):

  a  vLLM direct (LRU)       -> policy ``smg`` with no host tier (``--cpu-blocks 0``);
                                with one, ``lru-offload``: the engine's write-through host
                                tier, evicted LRU, of ``cpu_blocks x 32`` tokens less the
                                GPU pool
  b  ThunderAgent + vLLM     -> ``thunderagent``; with a host tier ``thunderagent+offload``
  c  mori serve + vLLM       -> policy ``mori`` on an engine without the plug-in
                                (``SimConfig.plugin`` False): the engine's own host tier,
                                written through and evicted LRU, which the policy does not
                                see; admission first come first served
  d  MORI + vLLM plug-in     -> policy ``mori``, CPU tier of ``cpu_blocks x 32`` tokens
                                less the GPU pool (the host tier is write-through: it also
                                mirrors the GPU; the gateway's vLLM adapter sizes it so)

The engine is the ``cpu-tiny-llama`` preset with the engine constants the bench measured
at the start of its run (``bench_vllm_agents.py --calibrate``, on by default: its
``settings.calibration``), or those of ``--calibration FILE``
(``bench/calibrate_cpu_engine.py --json FILE``); a file with neither is simulated with
the preset's own constants, which a shared machine's engine may be several times off
on another day.

The simulated ``mori`` prices recomputes and reloads with the rates the bench told
``mori serve`` (``--recompute-tok-s``, ``--reload-gbps``): as the bench file records
them, or for a file from before it did, as the bench computes them from today's
``cpu-tiny-llama`` preset. The simulated answers are as long as the engine's were: the
tiny random-weight model stops at its end-of-sequence token after 1-2 tokens whatever
``max_tokens`` asks, so every step's output is cut at the arm's generated tokens per
request (median over its rounds), rounded up (``max_output_tokens``); a file without
those counts keeps the trace's lengths.

Arms ``c`` and ``d`` read their engine's queue as ``mori serve`` does
(``SimConfig.engine_queues``) where the run's gateway did
(``settings.mori_reads_engine_queues``; ``--engine-queues`` says so for a run recorded
before the bench did). With ``--fronts``, each arm's requests spend, outside the engine
and the gateway's hold, the fronts' time the run measured for it (``SimConfig.front_s``:
the client's hops and the gateway's path besides its hold, from the engine's and the
gateway's TTFT histograms; a run recorded before the bench measured them: none):
measured, not predicted, and approximate (means over request sets that differ at the
window's ends), so off by default. The table shows the TTFT (wall ms) real and
simulated beside it.

The table compares the cached share of prompt tokens, real ((GPU
hits + host-tier hits) / prompt tokens, from vLLM's counters) against simulated (GPU hits
+ CPU-tier reloads, / prompt tokens), and the requests completed per wall second. Where
the bench ran several rounds, the real figures are the medians of an arm's rounds (the
simulation is deterministic: one run); where it ran several host-tier sizes, each size
is compared on its own. Then, per size, the order of the arms by requests per second,
real against simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.bench_vllm_agents import policy_rates  # noqa: E402
from mori.cli.table import format_table  # noqa: E402
from mori.core.calibration import EngineCalibration  # noqa: E402
from mori.core.policy import PolicyConfig  # noqa: E402
from mori.sim.config import SimConfig  # noqa: E402
from mori.sim.metrics import RunResult  # noqa: E402
from mori.sim.runner import simulate  # noqa: E402
from mori.traces import TraceSet, default_traces, load_traces  # noqa: E402

PRESET = "cpu-tiny-llama"
ARM_POLICY = {"a": "smg", "b": "thunderagent", "c": "mori", "d": "mori"}
"""The simulator policy that models each bench arm (with a host tier: arm (a)
``lru-offload``, arm (b) ``thunderagent+offload``; see ``arm_policy``)."""
WITH_HOST_TIER = {"a": "lru-offload", "b": "thunderagent+offload"}
WITHIN_PP = 10.0
"""A simulated cached share within this many percentage points of the real one agrees."""
WITHIN_RATE = 0.15
"""Simulated requests per second within this share of the real ones agree."""
DEFAULT_BLOCK_SIZE = 32


@dataclass(frozen=True)
class Fidelity:
    """The comparison rows (one per modelled arm that ran) and notes on what was left out."""

    rows: list[dict[str, Any]]
    notes: list[str]


def arm_policy(name: str, settings: dict[str, Any]) -> str:
    """The policy that models arm ``name`` of a bench run with ``settings``."""
    if name in WITH_HOST_TIER and int(settings.get("cpu_blocks", 0)) > 0:
        return WITH_HOST_TIER[name]  # vLLM's own offloading: write-through, LRU
    return ARM_POLICY[name]


def rates_of(settings: dict[str, Any]) -> tuple[float, float]:
    """The recompute rate (tokens/s) and reload bandwidth (GB/s), in policy time, that the
    bench told ``mori serve``: as its file records them, or (a file from before it did)
    as ``bench_vllm_agents.policy_rates`` gives them from today's preset."""
    rates = settings.get("policy_rates")
    if rates is None:
        return policy_rates(float(settings["time_scale"]))
    try:
        recompute, reload = float(rates["recompute_tok_s"]), float(rates["reload_gbps"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError("settings.policy_rates must hold the numbers recompute_tok_s and "
                         f"reload_gbps, got {rates!r}") from e
    return recompute, reload


def output_cap(runs: list[dict[str, Any]]) -> int | None:
    """The real answers' length: the arm's generated tokens per completed request, the
    median over its rounds, rounded up (None where the file does not say)."""
    per_request: list[float | None] = [
        int(r["generation_tokens"]) / int(r["requests_completed"]) for r in runs
        if r.get("generation_tokens") is not None and r.get("requests_completed")]
    mid = _median(per_request)
    return max(1, math.ceil(mid)) if mid is not None else None


def sim_config(settings: dict[str, Any], arm: dict[str, Any], policy: str,
               max_output: int | None = None, front_s: float = 0.0) -> SimConfig:
    """The simulation of one bench arm: its workload and the engine's pools, the
    answers cut at ``max_output`` tokens (None: the trace's), and the policy priced with
    the rates the real gateway was told."""
    block = int(settings.get("block_size", DEFAULT_BLOCK_SIZE))
    gpu = (int(settings["blocks"]) - 1) * block  # vLLM keeps one block aside
    # the host tier is write-through: the policy's CPU tier is what it holds beyond the
    # GPU pool's mirror, as the gateway's vLLM adapter sizes it
    cpu = max(0, int(settings.get("cpu_blocks", 0)) * block - gpu)
    recompute, reload = rates_of(settings)
    return SimConfig(
        calibration=calibration_of(settings, arm),
        policy=policy, programs=int(settings["programs"]), hardware=PRESET,
        duration_s=float(settings["duration_s"]), seed=int(settings["seed"]),
        max_context=int(arm["max_context"]), gpu_kv_tokens=gpu,
        # smg and thunderagent: an engine without a host tier
        cpu_kv_tokens=cpu if policy not in ("smg", "thunderagent") else 0,
        plugin=arm["arm"] != "c",  # (c): mori serve on vLLM without the plug-in
        # mori serve reads its engine's queue (runs recorded before it did: not)
        engine_queues=(arm["arm"] in MORI_SERVE_ARMS
                       and bool(settings.get("mori_reads_engine_queues", False))),
        learn_costs="--no-learn-costs" not in str(settings.get("mori_args", "")),
        # the replay ran the trace's clock time_scale times faster than the wall: to the
        # trace, the real engine was that many times slower
        token_scale=float(settings["token_scale"]),
        engine_slowdown=float(settings["time_scale"]),
        max_output_tokens=max_output, front_s=front_s,
        policy_config=PolicyConfig(
            recompute_tok_s=recompute, reload_gbps=reload,
            fill_idle=arm["arm"] in MORI_SERVE_ARMS and bool(serve_flag(settings, "fill-idle")),
            gpu_overcommit=(float(serve_value(settings, "gpu-overcommit") or 1.0)
                            if arm["arm"] in MORI_SERVE_ARMS else 1.0),
            gpu_overcommit_max=(float(serve_value(settings, "gpu-overcommit-max") or 1.0)
                                if arm["arm"] in MORI_SERVE_ARMS else 1.0)))


def serve_flag(settings: dict[str, Any], name: str) -> bool | None:
    """Whether the run's ``--mori-args`` turned ``mori serve``'s ``--NAME`` on (True) or
    off (``--no-NAME``: False), the last one said winning; None where they say neither."""
    said = None
    for flag in str(settings.get("mori_args", "")).split():
        if flag == f"--{name}":
            said = True
        elif flag == f"--no-{name}":
            said = False
    return said


def serve_value(settings: dict[str, Any], name: str) -> str | None:
    """The value the run's ``--mori-args`` gave ``mori serve``'s ``--NAME`` (``--NAME V``
    or ``--NAME=V``), the last one said winning; None where they give none."""
    flags = str(settings.get("mori_args", "")).split()
    said = None
    for i, flag in enumerate(flags):
        if flag == f"--{name}" and i + 1 < len(flags):
            said = flags[i + 1]
        elif flag.startswith(f"--{name}="):
            said = flag.split("=", 1)[1]
    return said


def front_of(runs: list[dict[str, Any]]) -> float | None:
    """The fronts' time per request the bench measured for an arm, in seconds (the
    median over its rounds): the client's hops, and the gateway's path besides its hold
    (``bench_vllm_agents.latency_split``); None where the run did not measure it."""
    per_run = []
    for r in runs:
        hop, path = r.get("client_hop_mean_ms"), r.get("gateway_path_mean_ms")
        if hop is not None:
            per_run.append(max(0.0, hop + (path or 0.0)) / 1000.0)
    return statistics.median(per_run) if per_run else None


MORI_SERVE_ARMS = frozenset({"c", "d"})
"""The arms behind ``mori serve``."""

GATEWAY_TOKENIZES = MORI_SERVE_ARMS
"""The arms whose gateway asks the engine's ``/tokenize`` for every request
(``mori serve --exact-tokens``, as the bench starts it, unless its ``--mori-args`` say
``--no-exact-tokens``: ``tokenizes``)."""


def tokenizes(settings: dict[str, Any], arm: str) -> bool:
    """Whether the run's gateway for ``arm`` asked ``/tokenize`` for every request."""
    flags = str(settings.get("mori_args", "")).split()
    return arm in GATEWAY_TOKENIZES and "--no-exact-tokens" not in flags


def calibration_of(settings: dict[str, Any], arm: dict[str, Any] | None = None
                   ) -> EngineCalibration | None:
    """The engine constants the bench measured at the start of its run (None: a file
    from a run without ``--calibrate``; the preset's constants are simulated). For an
    arm whose gateway asks ``/tokenize`` for every request, that call's measured time
    at the arm's mean prompt is added to the time each request costs the engine
    (``request_overhead_s``): the API server that answers it runs on the engine's CPU."""
    measured = settings.get("calibration")
    if not measured:
        return None
    try:
        cal = EngineCalibration.from_document(measured)
    except ValueError as e:
        raise ValueError(f"settings.calibration must hold the bench's constants: {e}") from e
    fit = measured.get("tokenize")
    if arm is None or not tokenizes(settings, str(arm.get("arm"))) or not isinstance(fit, dict):
        return cal
    requests = int(arm.get("requests_with_usage") or arm.get("requests_completed") or 0)
    prompt = int(arm.get("prompt_tokens") or 0) / requests if requests else 0.0
    extra = float(fit.get("fixed_s", 0.0)) + float(fit.get("per_token_s", 0.0)) * prompt
    return dataclasses.replace(cal, request_overhead_s=cal.request_overhead_s + max(0.0, extra))


def real_cached_share(arm: dict[str, Any]) -> float | None:
    """(GPU + host-tier prefix hits) / prompt tokens, from the engine's counters."""
    prompt = int(arm["prompt_tokens"])
    if prompt <= 0:
        return None
    return (int(arm["cached_tokens_gpu"]) + int(arm["cached_tokens_cpu"])) / prompt


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def compare_arm(settings: dict[str, Any], runs: list[dict[str, Any]], traces: TraceSet
                ) -> dict[str, Any]:
    """One comparison row: the real arm's figures (medians over ``runs``, the rounds of
    one arm at one host-tier size) next to its simulation's."""
    arm = runs[0]
    policy = arm_policy(arm["arm"], settings)
    cap = output_cap(runs)
    front = front_of(runs) if settings.get("sim_fronts", False) else None
    result: RunResult = simulate(sim_config(settings, arm, policy, cap, front or 0.0), traces)
    window_s = float(settings["duration_s"]) / float(settings["time_scale"])

    def share(r: dict[str, Any], key: str) -> float | None:
        prompt = int(r["prompt_tokens"])
        return int(r[key]) / prompt if prompt > 0 else None

    real = _median([real_cached_share(r) for r in runs])
    sim = result.gpu_hit_rate + result.cpu_hit_rate
    diff_pp = None if real is None else 100.0 * (sim - real)
    completed = [r.get("requests_completed") for r in runs]
    return {
        "arm": arm["arm"], "name": arm.get("name", ""),
        "sim_policy": policy if arm["arm"] != "c" else f"{policy}, no plug-in",
        "cpu_blocks": int(settings.get("cpu_blocks", 0)), "real_runs": len(runs),
        "real_prompt_tokens": _median([int(r["prompt_tokens"]) for r in runs]),
        "real_cached_share": real,
        "real_cached_share_gpu": _median([share(r, "cached_tokens_gpu") for r in runs]),
        "real_cached_share_cpu": _median([share(r, "cached_tokens_cpu") for r in runs]),
        "sim_prompt_tokens": result.prompt_tokens,
        "sim_cached_share": sim,
        "sim_cached_share_gpu": result.gpu_hit_rate,
        "sim_cached_share_cpu": result.cpu_hit_rate,
        "diff_pp": diff_pp,
        "within": None if diff_pp is None else abs(diff_pp) <= WITHIN_PP,
        "real_requests_completed": _median([float(c) for c in completed if c is not None]),
        "sim_requests_completed": result.steps,
        "real_requests_per_s": _median([float(c) / window_s for c in completed
                                        if c is not None]),
        "sim_requests_per_s": result.steps / window_s,
        "rate_error": rate_error(result.steps / window_s, _median(
            [float(c) / window_s for c in completed if c is not None])),
        # TTFT in wall milliseconds: the simulator's engine runs engine_slowdown (the
        # replay's time_scale) times slower than the trace's clock, as the replay's does
        # against the wall
        "real_ttft_p50_ms": _ms(_median([r.get("ttft_p50_wall_s") for r in runs])),
        "real_ttft_p90_ms": _ms(_median([r.get("ttft_p90_wall_s") for r in runs])),
        "sim_ttft_p50_ms": _ms(result.ttft_p50_s / float(settings["time_scale"])),
        "sim_ttft_p90_ms": _ms(result.ttft_p90_s / float(settings["time_scale"])),
        "sim_front_ms": _ms(front),
        "sim_gpu_kv_tokens": result.gpu_kv_capacity_tokens,
        "sim_cpu_kv_tokens": result.cpu_kv_capacity_tokens,
        "max_context": result.max_context,
        "sim_max_output_tokens": cap,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or math.isnan(seconds) else 1000.0 * seconds


def rate_error(sim: float, real: float | None) -> float | None:
    """(simulated - real) / real requests per second (None: no real figure)."""
    return None if not real else (sim - real) / real


def arm_order(rows: list[dict[str, Any]], key: str) -> list[str]:
    """The arms of ``rows`` from most to fewest requests per second by ``key``."""
    return [r["arm"] for r in sorted(rows, key=lambda r: -(r[key] or 0.0))]


def fidelity(doc: dict[str, Any], traces: TraceSet) -> Fidelity:
    """Simulate every arm of ``doc`` (a bench JSON) the simulator models and compare."""
    base = doc["settings"]
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    if base.get("traces") not in (None, traces.name):
        notes.append(f"the bench replayed trace set {base['traces']!r}, the simulation "
                     f"{traces.name!r}: pass --traces")
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for arm in doc["arms"]:
        name = arm.get("arm")
        size = int(arm.get("cpu_blocks", base.get("cpu_blocks", 0)))
        if name not in ARM_POLICY:
            note = f"arm ({name}) is not modelled by the simulator; skipped"
            if note not in notes:
                notes.append(note)
            continue
        if not arm.get("ok"):
            notes.append(f"arm ({name}) failed in the bench (host tier {size}, round "
                         f"{arm.get('round', 1)}); skipped")
            continue
        groups.setdefault((size, name), []).append(arm)
    for (size, _), runs in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        rows.append(compare_arm({**base, "cpu_blocks": size}, runs, traces))
    return Fidelity(rows, notes)


def orders(rows: list[dict[str, Any]]) -> list[str]:
    """Per host-tier size, the arms' order by requests per second, real and simulated."""
    lines = []
    for size in dict.fromkeys(r["cpu_blocks"] for r in rows):
        these = [r for r in rows if r["cpu_blocks"] == size]
        if len(these) < 2:
            continue
        real, sim = arm_order(these, "real_requests_per_s"), arm_order(these, "sim_requests_per_s")
        lines.append(f"host tier {size} blocks: requests per second, most first: real "
                     f"{' > '.join(real)}, simulated {' > '.join(sim)}: order "
                     f"{'agrees' if real == sim else 'DIFFERS'}")
    return lines


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _ttft(p50: float | None, p90: float | None) -> str:
    return "-" if p50 is None or p90 is None else f"{p50:,.0f} / {p90:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The comparison as a text table."""
    headers = ("host tier", "arm", "sim policy", "real cached", "(GPU / CPU)", "sim cached",
               "(GPU / CPU)", "diff (pp)", f"within {WITHIN_PP:g} pp", "req/s real",
               "req/s sim", "sim vs real", f"within {WITHIN_RATE:.0%}",
               "TTFT p50/p90 ms real", "sim", "fronts ms", "sim answers")
    out = []
    for r in rows:
        diff = "-" if r["diff_pp"] is None else f"{r['diff_pp']:+.1f}"
        within = "-" if r["within"] is None else ("yes" if r["within"] else "no")
        real_req = r["real_requests_per_s"]
        out.append([
            str(r["cpu_blocks"]), f"({r['arm']}) {r['name']}".strip(), r["sim_policy"],
            _pct(r["real_cached_share"]),
            f"{_pct(r['real_cached_share_gpu'])} / {_pct(r['real_cached_share_cpu'])}",
            _pct(r["sim_cached_share"]),
            f"{_pct(r['sim_cached_share_gpu'])} / {_pct(r['sim_cached_share_cpu'])}",
            diff, within, "-" if real_req is None else f"{real_req:.2f}",
            f"{r['sim_requests_per_s']:.2f}",
            "-" if r["rate_error"] is None else f"{r['rate_error']:+.0%}",
            "-" if r["rate_error"] is None else (
                "yes" if abs(r["rate_error"]) <= WITHIN_RATE else "no"),
            _ttft(r.get("real_ttft_p50_ms"), r.get("real_ttft_p90_ms")),
            _ttft(r.get("sim_ttft_p50_ms"), r.get("sim_ttft_p90_ms")),
            "-" if r.get("sim_front_ms") is None else f"{r['sim_front_ms']:.1f}",
            "trace" if r.get("sim_max_output_tokens") is None else
            f"<= {r['sim_max_output_tokens']} tok"])
    right = [True, False, False] + [True] * (len(headers) - 3)
    return format_table(headers, out, right)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json", type=Path,
                    help="the file `bench/bench_vllm_agents.py --json FILE` wrote")
    ap.add_argument("--traces", type=Path, default=None,
                    help="the trace set the bench replayed (default: the shipped one)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                    help="simulate with this calibration (`bench/calibrate_cpu_engine.py "
                         "--json FILE`) instead of the one the bench recorded, e.g. for a "
                         "file from a run without one (default: the bench's, else the "
                         "preset's constants)")
    ap.add_argument("--engine-queues", action=argparse.BooleanOptionalAction, default=None,
                    help="whether the run's mori serve read its engine's waiting count "
                         "(default: as the run recorded; runs recorded before the bench "
                         "said so: no)")
    ap.add_argument("--fronts", action=argparse.BooleanOptionalAction, default=False,
                    help="simulate each arm with the fronts' time per request the run "
                         "measured (SimConfig.front_s; runs that did not measure it: none). "
                         "Off by default: the measurement subtracts means over request sets "
                         "that differ at the window's ends, and varied from 3 to 100 ms a "
                         "request between runs of the same arm")
    args = ap.parse_args(argv)
    try:
        doc = json.loads(args.bench_json.read_text(encoding="utf-8"))
        doc["settings"]["sim_fronts"] = args.fronts
        if args.engine_queues is not None:
            doc["settings"]["mori_reads_engine_queues"] = args.engine_queues
        if args.calibration is not None:
            doc["settings"]["calibration"] = json.loads(
                args.calibration.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        print(f"sim_fidelity: cannot read {args.bench_json} or its calibration: {e}",
              file=sys.stderr)
        return 2
    traces = load_traces(args.traces) if args.traces else default_traces()
    try:
        report = fidelity(doc, traces)
    except (KeyError, TypeError, ValueError) as e:
        print(f"sim_fidelity: {args.bench_json} is not a file bench_vllm_agents.py wrote "
              f"as this script reads it: {e!r}", file=sys.stderr)
        return 2
    s = doc["settings"]
    sizes = s.get("cpu_blocks_runs", [s.get("cpu_blocks", 0)])
    print(f"{s['programs']} programs of {traces.name!r}, {s['duration_s']:g} s at time scale "
          f"{s['time_scale']:g}, token scale {s['token_scale']:g}, {s['blocks']} blocks, host "
          f"tier {'/'.join(map(str, sizes))} blocks; simulated on {PRESET}"
          f"{' as calibrated in the run' if s.get('calibration') else ' (its own constants)'}")
    print(table(report.rows) if report.rows else "no arm to compare")
    for line in orders(report.rows):
        print(line)
    for note in report.notes:
        print(f"note: {note}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": report.rows, "notes": report.notes},
                                        indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
