"""Agent programs on one real vLLM, four ways: requests completed per second, and how
many prompt tokens each recomputes.

    python bench/bench_vllm_agents.py [--setting default|bottleneck] [--programs N]
        [--duration S] [--time-scale X] [--token-scale 0.01] [--blocks N]
        [--cpu-blocks N[,N...]] [--rounds 1] [--engine-cpus auto] [--seed 0]
        [--arms a,b,c,d] [--mori-args 'FLAGS'] [--no-calibrate] [--json FILE]

``--setting default`` (8 programs, time scale 10, 128 blocks, host tier 256) is bound by
the programs' tool time; ``--setting bottleneck`` (32 programs, time scale 100, 256
blocks, host tiers 512 and 256) keeps plain vLLM's queue full, so that what an arm saves
shows as requests per second. The headline per run: completed requests and output tokens
per wall second, TTFT p50 / p90, recomputed tokens per request, and how often the engine
had requests queued (``vllm:num_requests_waiting`` > 0, sampled every 0.25 s). With
``--rounds N`` every arm runs N times, alternating (a b c d, a b c d, ...), and a summary
gives each arm's median and range and (d)'s ratio to each other arm round by round. With
two or more CPUs the engine runs on one of its own (``--engine-cpus``) and everything
else on the rest, as a GPU's compute is not its host's; each arm records the mean busy
share of the engine's CPUs and of the rest over its replay (``/proc/stat``).

First (``--calibrate``, the default) the engine is timed as
``bench/calibrate_cpu_engine.py`` times it, on one engine like the arms' (the same pool
and CPUs, a host tier): prefills of 256, 1,024 and 2,048 fresh tokens, a decode step,
reloads from the host tier and ``/tokenize`` calls, about two minutes. ``mori serve`` is
told the recompute rate and reload bandwidth of the ``cpu-tiny-llama`` preset with the
constants fitted to those timings, in policy time (``--no-calibrate``: the preset's
own), and the results record the timings and constants (``settings.calibration``), which
``bench/sim_fidelity.py`` simulates with. The same engine on this shared machine has run
six times slower on one day than on another, so a run is compared with a calibration of
its own.

The same agent programs (the shipped real traces, or ``--traces``; the same ``--seed``)
are replayed closed-loop by ``mori replay``'s client against four arms, each on a fresh
vLLM CPU engine (``scripts/start_vllm_cpu.sh``, tiny random-weight model, the same pool of
``--blocks`` blocks of 32 tokens, the same host KV tier of ``--cpu-blocks`` blocks, and
the same flags):

  a  vLLM directly (no gateway; vLLM ignores the ``program_id`` field it does not know)
  b  ThunderAgent (``--router tr``) in front of vLLM; programs are released through its
     ``POST /programs/release``
  c  ``mori serve --backend vllm=URL,kv_events=...`` (plain vLLM engine, LRU eviction)
  d  ``mori serve --backend vllm=URL,kv_events=...,labels=...`` with MORI's scheduler
     plug-in loaded in the engine (``MORI_VLLM_PLUGIN=1``: typed eviction on the GPU and
     in the host tier, whose size the gateway learns from the plug-in's handshake;
     ``prefetch=false``: no warm-up requests, so that every arm's engine prompt tokens
     are the clients' prompts)

The host tier (``MORI_VLLM_CPU_GIB``, ``mori vllm-args --cpu-gib``) is vLLM's
``OffloadingConnector`` with MORI's copy worker for the CPU build: every full block is
written through to it and loaded back on a prefix hit. Arms (a), (b) and (c) evict it by
vLLM's ``lru`` policy, arm (d) by MORI's labels. ``--cpu-blocks 0`` runs without it.

Scaling to the tiny model: prompts are sent as text (``--text-prompts``); ``--token-scale``
is engine tokens per trace token. The tiny model's tokenizer turns replay's 4 characters
into more than one token, so the ratio is measured with the engine's ``/tokenize`` and
replay's own token scale is set to ``--token-scale / ratio``; programs are cut where their
context (plus the largest answer) would pass the engine's ``max_model_len``. Gaps are
slept ``/ --time-scale`` (``mori serve`` runs its policy clock at that scale; ThunderAgent's
scheduler and metrics intervals, 5 s by default, are divided by it too).

Source of truth for tokens: the engine's own counters (``vllm:prompt_tokens_total``,
``vllm:prefix_cache_hits_total`` (GPU), ``vllm:external_prefix_cache_hits_total`` (host
tier), ``vllm:prefix_cache_queries_total``, ``vllm:num_preemptions_total``), read from
the engine's ``/metrics`` before and after each arm. Recomputed = prompt - cached (GPU +
host tier). The replay runs for a fixed time, so arms that hold requests back complete
fewer of them: the recomputed share (recomputed / prompt) and recomputed per completed
request compare arms fairly; the absolute count does not. A program's first turn has
nothing to reuse, so part of every arm's recompute is cold; "later turns: recomputed
share" counts only the turns whose prefix was computed before (from the usage the engine
returns with each completed request: ``prompt_tokens`` less
``prompt_tokens_details.cached_tokens``), the misses a cache policy can avoid.

Each arm's processes run in their own process groups and are stopped at the arm's end,
on failure too; a failing arm is reported as failed with the reason, the others run.
ThunderAgent is installed (once) into its own venv, ``$MORI_CACHE/thunderagent-venv``
(default ``~/.cache/mori``), from its source (``--thunderagent-src``; fastapi, httpx and
uvicorn from the package index). Needs the vLLM CPU venv and the tiny model
(``scripts/vllm_cpu_env.sh``, ``scripts/make_tiny_model.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import signal
import statistics
import string
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.ttft_split import latency_line, latency_split, timer_means, timer_sums
from bench.vllm_arms import (
    BLOCK_SIZE,
    ArmFailed,
    Processes,
    http_get,
    http_post,
    start_engine,
    start_mori,
    start_thunderagent,
    tail,
    thunderagent_exe,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mori.cli.table import format_table  # noqa: E402
from mori.core.calibration import EngineCalibration  # noqa: E402
from mori.core.costmodel import CostModel  # noqa: E402
from mori.core.hardware import get_preset  # noqa: E402
from mori.engines.http import parse_prometheus  # noqa: E402
from mori.replay import client as replay_client  # noqa: E402
from mori.replay.config import ReplayConfig  # noqa: E402
from mori.traces import TraceSet, default_traces, load_traces  # noqa: E402

CHARS_PER_TOKEN = 4  # what replay's text prompts assume
PRESET = "cpu-tiny-llama"  # the simulator's model of this engine
ANSWER_MARGIN = 160  # engine tokens kept free for the answer and the chat template

ARMS = {
    "a": "vLLM direct",
    "b": "ThunderAgent + vLLM",
    "c": "mori serve + vLLM",
    "d": "mori serve + vLLM + plug-in",
}
COUNTERS = {
    "prompt": "vllm:prompt_tokens_total",
    "hits": "vllm:prefix_cache_hits_total",
    "cpu_hits": "vllm:external_prefix_cache_hits_total",
    "loaded_bytes": "vllm:kv_offload_load_bytes_total",
    "queries": "vllm:prefix_cache_queries_total",
    "preemptions": "vllm:num_preemptions_total",
    "generation": "vllm:generation_tokens_total",
}


# -- measuring ----------------------------------------------------------------------------
def engine_counters(url: str) -> dict[str, float]:
    status, text = http_get(url + "/metrics", timeout=10.0)
    if status != 200:
        raise ArmFailed(f"the engine's /metrics answered {status or 'nothing'}")
    samples = parse_prometheus(text)
    return {key: sum(v for _, v in samples.get(name, [])) for key, name in COUNTERS.items()}


class LoadSampler:
    """Samples the engine's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
    every ``interval_s`` from a thread, while the replay runs: how often requests queue
    behind a full batch (the engine is the bottleneck then), and the mean batch."""

    def __init__(self, url: str, interval_s: float = 0.25) -> None:
        self.url, self.interval_s = url, interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            status, text = http_get(self.url + "/metrics", timeout=2.0)
            if status != 200:
                continue
            m = parse_prometheus(text)
            running = sum(v for _, v in m.get("vllm:num_requests_running", []))
            waiting = sum(v for _, v in m.get("vllm:num_requests_waiting", []))
            self.samples.append((running, waiting))

    def summary(self) -> dict[str, float | int | None]:
        n = len(self.samples)
        if not n:
            return {"load_samples": 0, "queued_share": None, "running_mean": None,
                    "waiting_mean": None}
        return {"load_samples": n,
                "queued_share": sum(1 for _, w in self.samples if w > 0) / n,
                "running_mean": sum(r for r, _ in self.samples) / n,
                "waiting_mean": sum(w for _, w in self.samples) / n}


def cpu_times() -> dict[int, tuple[int, int]]:
    """Each CPU's (busy, total) jiffies from ``/proc/stat`` (empty where there is none)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        lines = Path("/proc/stat").read_text(encoding="ascii").splitlines()
    except OSError:
        return out
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu" and name[3:].isdigit():
            ticks = [int(f) for f in fields]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def busy_shares(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
                ) -> dict[int, float]:
    """Each CPU's busy share between two ``cpu_times`` readings."""
    out = {}
    for cpu, (busy, total) in after.items():
        if cpu in before and total > before[cpu][1]:
            out[cpu] = (busy - before[cpu][0]) / (total - before[cpu][1])
    return out


def mean_busy(shares: dict[int, float], cpus: frozenset[int] | None) -> float | None:
    """The mean busy share of ``cpus`` (None: of all) over the replay, or None."""
    these = [v for c, v in shares.items() if cpus is None or c in cpus]
    return sum(these) / len(these) if these else None


def tokens_per_text_token(url: str) -> float:
    """Engine tokens per ``CHARS_PER_TOKEN`` characters of text like replay's prompts
    (three-letter lowercase words), from the engine's ``/tokenize``."""
    rng = random.Random(7)
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=3)) for _ in range(4096)]
    text = " ".join(rng.choices(vocab, k=6000))
    out = http_post(url + "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False})
    return float(out["count"]) / (len(text) / CHARS_PER_TOKEN)


@dataclass(frozen=True)
class Settings:
    programs: int
    duration_s: float
    time_scale: float
    token_scale: float  # engine tokens per trace token
    blocks: int
    seed: int
    cpu_blocks: int = 0  # host-tier blocks (0: no host tier)
    engine_cpus: frozenset[int] | None = None  # the engine's own CPUs (None: shared)
    mori_args: tuple[str, ...] = ()  # more flags for mori serve (arms c and d)
    calibration: EngineCalibration | None = None  # this run's, else the preset's constants


def policy_rates(time_scale: float, calibration: EngineCalibration | None = None
                 ) -> tuple[float, float]:
    """The recompute rate (tokens/s) and reload bandwidth (GB/s) of the engine, as the
    ``cpu-tiny-llama`` preset models it (with ``calibration``: as measured at the start of
    this run), in ``mori serve``'s policy time: wall rates over the time scale. Left at
    ``mori serve``'s defaults (a GPU's), the policy would price a drop at a fraction of
    what it costs here."""
    preset = get_preset(PRESET)
    if calibration is not None:
        preset = calibration.applied_to(preset)
    recompute = CostModel(preset).prefill_rate(context=2_048)
    return recompute / time_scale, preset.gpu.reload_bw / 1e9 / time_scale


CALIBRATION_SIZES = (64, 256, 1024, 2048)
"""Prefill sizes (engine tokens) the run's calibration times; reloads at those >= 512.
Four sizes for three unknowns per request (linear, attention, fixed): with three, the
fit passed through every point, and one noisy timing once put the fixed part at 1.2 ms
where the other runs of the day fitted 3.7-16.8 ms."""


def calibrate(blocks: int, cpus: frozenset[int] | None, *, host_tier: bool
              ) -> dict[str, Any]:
    """This run's engine constants: ``bench/calibrate_cpu_engine.py``'s measurements on
    one engine of ``blocks`` blocks on ``cpus`` (with a host tier where the arms have
    one: their prefills write through to it), and the constants fitted to them."""
    from bench.calibrate_cpu_engine import (  # it imports this module
        fitted_constants,
        measure,
        tokenize_fit,
    )

    print("calibrating the engine ...", file=sys.stderr, flush=True)
    m = measure(blocks, cpus, list(CALIBRATION_SIZES), 3, host_tier=host_tier,
                one_engine=True)
    constants = fitted_constants(m.points, m.step, m.reloads)
    print("calibration: " + ", ".join(f"{k}={v:.4g}" for k, v in constants.items()),
          file=sys.stderr, flush=True)
    return {"constants": constants, "prefill": m.points, "decode_step_s": m.step,
            "reloads": m.reloads, "tokenize": tokenize_fit(m.tokenize),
            "sizes": list(CALIBRATION_SIZES)}


def max_output_tokens(traces: TraceSet) -> int:
    return max((s.output_tokens for p in traces.programs for s in p.steps), default=0)


def replay_config(target: str, s: Settings, ratio: float, max_model_len: int,
                  max_output: int) -> ReplayConfig:
    margin = max(ANSWER_MARGIN, math.ceil(max_output * s.token_scale) + 64)
    max_context = max(1, int((max_model_len - margin) / (s.token_scale * 1.03)))
    return ReplayConfig(target=target, programs=s.programs, duration_s=s.duration_s,
                        time_scale=s.time_scale, seed=s.seed, max_context=max_context,
                        text_prompts=True, token_scale=s.token_scale / ratio,
                        request_timeout_s=max(120.0, s.duration_s / s.time_scale))


async def _release_thunderagent(self: Any, pid: str) -> None:
    """Replay's release, sent the way ThunderAgent takes it: POST /programs/release."""
    try:
        r = await self.http.post(f"{self.cfg.base_url}/programs/release",
                                 json={"program_id": pid}, headers=self.headers, timeout=10.0)
    except Exception:
        self.release_errors += 1
        return
    if r.status_code >= 400:
        self.release_errors += 1
    self.release_supported = True


def run_replay(cfg: ReplayConfig, traces: TraceSet, thunderagent: bool) -> Any:
    patch = (mock.patch.object(replay_client._Replayer, "_release", _release_thunderagent)
             if thunderagent else contextlib.nullcontext())
    with patch:
        return asyncio.run(replay_client.replay(cfg, traces))


def run_arm(arm: str, s: Settings, traces: TraceSet, logs: Path,
            ta_src: Path | None) -> dict[str, Any]:
    procs = Processes()
    t0 = time.monotonic()
    row: dict[str, Any] = {"arm": arm, "name": ARMS[arm], "ok": False}
    try:
        exe = thunderagent_exe(ta_src) if arm == "b" else None
        engine = start_engine(procs, logs, s.blocks, s.cpu_blocks, plugin=arm == "d",
                              arm=arm, cpus=s.engine_cpus)
        row["engine_start_s"] = round(engine.start_s, 1)
        status, body = http_get(engine.url + "/v1/models")
        max_model_len = int(json.loads(body)["data"][0]["max_model_len"]) if status == 200 else 0
        if max_model_len <= 0:
            raise ArmFailed("the engine reports no max_model_len")
        ratio = tokens_per_text_token(engine.url)
        gateway_log: Path | None = None
        if arm == "a":
            target = engine.url
        elif arm == "b":
            assert exe is not None
            target = start_thunderagent(procs, logs, engine, exe, s.time_scale)
        else:
            target, gateway_log = start_mori(procs, logs, engine, s.time_scale, arm,
                                             policy_rates(s.time_scale, s.calibration),
                                             s.mori_args)
        cfg = replay_config(target, s, ratio, max_model_len, max_output_tokens(traces))
        before = engine_counters(engine.url)
        timers_before = timer_sums(engine.url, ("engine_ttft",))
        if arm in ("c", "d"):
            timers_before |= timer_sums(target, ("gateway_ttft", "gateway_held"))
        cpu_before = cpu_times()
        with LoadSampler(engine.url) as load:
            result = run_replay(cfg, traces, thunderagent=arm == "b")
        cpu_busy = busy_shares(cpu_before, cpu_times())
        time.sleep(1.0)  # the engine finishes aborting what the replay cancelled
        after = engine_counters(engine.url)
        timers_after = timer_sums(engine.url, ("engine_ttft",))
        if arm in ("c", "d"):
            timers_after |= timer_sums(target, ("gateway_ttft", "gateway_held"))
        window_s = s.duration_s / s.time_scale  # the replay's wall window
        d = {k: int(round(after[k] - before[k])) for k in COUNTERS}
        recomputed = d["prompt"] - d["hits"] - d["cpu_hits"]
        row.update({
            "ok": True, "target": target, "max_model_len": max_model_len,
            "engine_tokens_per_text_token": round(ratio, 3),
            "replay_token_scale": cfg.token_scale, "max_context": cfg.max_context,
            "requests_sent": result.requests, "requests_completed": result.steps,
            "errors": result.error_count, "errors_by_kind": result.errors,
            "release_errors": result.release_errors,
            "programs_started": result.programs_started,
            "programs_finished": result.programs_finished,
            "programs_left_out": result.programs_left_out,
            "programs_served": len({e.program_id for e in result.events
                                    if e.error is None and e.end_s is not None}),
            "prompt_tokens": d["prompt"], "cached_tokens_gpu": d["hits"],
            "cached_tokens_cpu": d["cpu_hits"], "cpu_tier_loaded_bytes": d["loaded_bytes"],
            "prefix_cache_queries": d["queries"],
            "recomputed_tokens": recomputed,
            "recomputed_share": recomputed / d["prompt"] if d["prompt"] else None,
            "recomputed_per_request": (recomputed / result.steps if result.steps else None),
            "generation_tokens": d["generation"], "preemptions": d["preemptions"],
            "requests_per_s": result.steps / window_s,
            "output_tokens_per_s": d["generation"] / window_s,
            **load.summary(),
            "engine_cpu_busy": mean_busy(cpu_busy, s.engine_cpus),
            "front_cpu_busy": mean_busy(cpu_busy, None if s.engine_cpus is None else
                                        frozenset(cpu_busy) - s.engine_cpus),
            "wall_s": round(result.wall_s, 2),
            "ttft_p50_wall_s": _wall(result.ttft_p50_s, s.time_scale),
            "ttft_p90_wall_s": _wall(result.ttft_p90_s, s.time_scale),
            **latency_split(_wall(result.ttft_mean_s, s.time_scale),
                            timer_means(timers_before, timers_after)),
            **turn_split(result.events),
            "held_requests": result.held_requests, "promotions": result.promotions,
            "demotions_to_none": result.demotions_to_none,
        })
        if arm in ("c", "d"):  # the engine's prices as the gateway learned them
            with contextlib.suppress(Exception):
                rows = json.loads(http_get(target + "/v1/replicas")[1])["data"]
                row["engine_costs"] = rows[0]["costs"]
                row["gpu_tier_end"] = rows[0].get("gpu_tier")  # the tier as the run ended
        if gateway_log is not None and arm == "d":
            # the gateway warns when the plug-in does not answer, or stops answering
            text = gateway_log.read_text(errors="replace")
            row["typed_eviction"] = "plain LRU" not in text
            # the plug-in logs a summary line for the label updates it applies
            row["plugin_label_updates_logged"] = tail(logs / "d-vllm.log", 10**6).count(
                "MORI labels applied")
            if not row["typed_eviction"]:
                row["note"] = ("the plug-in did not answer the gateway (all or part of the "
                               "run): eviction was plain LRU then")
    except ArmFailed as e:
        row["reason"] = str(e)
    except Exception as e:  # any other failure of this arm: report it, run the others
        row["reason"] = f"{type(e).__name__}: {e}"
    finally:
        procs.stop()
        row["arm_wall_s"] = round(time.monotonic() - t0, 1)
    return row


def turn_split(events: Any) -> dict[str, Any]:
    """Prompt and recomputed tokens of first turns (nothing to reuse: cold) and of later
    turns (their prefix was computed before: a miss is a recompute the cache could have
    saved), from the usage the engine returned to the client with each completed
    request."""
    out: dict[str, Any] = {"first_turn_prompt": 0, "first_turn_recomputed": 0,
                           "later_turn_prompt": 0, "later_turn_recomputed": 0,
                           "requests_with_usage": 0}
    for e in events:
        if e.error is not None or e.end_s is None or e.prompt_tokens is None:
            continue
        out["requests_with_usage"] += 1
        kind = "first_turn" if e.step == 0 else "later_turn"
        out[f"{kind}_prompt"] += e.prompt_tokens
        out[f"{kind}_recomputed"] += e.prompt_tokens - (e.cached_tokens or 0)
    later = out["later_turn_prompt"]
    out["later_turn_recomputed_share"] = (out["later_turn_recomputed"] / later
                                          if later else None)
    return out


def _wall(sim_s: float, time_scale: float) -> float | None:
    return None if sim_s is None or math.isnan(sim_s) else sim_s / time_scale


# -- output -------------------------------------------------------------------------------
HEADERS = ("arm", "round", "requests / s", "output tok / s", "TTFT p50 / p90 ms",
           "recomputed / req", "recomputed share", "later turns: recomputed share",
           "cached GPU / CPU", "engine queued", "requests done", "programs served", "errors",
           "preemptions")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per run: the headline rates first, then where the prompt tokens went."""
    out = []
    for r in rows:
        label = f"({r['arm']}) {r['name']}"
        if not r["ok"]:
            out.append([label, str(r.get("round", 1)), "FAILED"] + [""] * (len(HEADERS) - 3))
            continue
        per = r["recomputed_per_request"]
        out.append([
            label, str(r.get("round", 1)), f"{r['requests_per_s']:.2f}",
            f"{r['output_tokens_per_s']:.1f}",
            f"{_ms(r['ttft_p50_wall_s'])} / {_ms(r['ttft_p90_wall_s'])}",
            "-" if per is None else f"{per:,.0f}", _pct(r["recomputed_share"]),
            _pct(r.get("later_turn_recomputed_share")),
            f"{r['cached_tokens_gpu']:,} / {r['cached_tokens_cpu']:,}",
            _pct(r.get("queued_share")), str(r["requests_completed"]),
            str(r["programs_served"]), str(r["errors"]), str(r["preemptions"])])
    return format_table(HEADERS, out, [False] + [True] * (len(HEADERS) - 1))


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "-"
    mid = statistics.median(values)
    if len(values) == 1:
        return format(mid, fmt)
    return f"{format(mid, fmt)} [{format(min(values), fmt)} - {format(max(values), fmt)}]"


SUMMARY = (("requests / s", "requests_per_s", ".2f", 1.0),
           ("output tok / s", "output_tokens_per_s", ".1f", 1.0),
           ("TTFT p50 ms", "ttft_p50_wall_s", ".0f", 1000.0),
           ("TTFT p90 ms", "ttft_p90_wall_s", ".0f", 1000.0),
           ("recomputed / req", "recomputed_per_request", ",.0f", 1.0),
           ("engine queued %", "queued_share", ".1f", 100.0),
           ("engine running", "running_mean", ".2f", 1.0))


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Per arm, the median of its runs and their range."""
    out = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        runs = [r for r in rows if r["arm"] == arm and r["ok"]]
        line = [f"({arm}) {ARMS[arm]}", str(len(runs))]
        for _, key, fmt, scale in SUMMARY:
            vals = [float(r[key]) * scale for r in runs if r.get(key) is not None]
            line.append(_spread(vals, fmt))
        out.append(line)
    headers = ("arm", "runs", *(h for h, *_ in SUMMARY))
    return format_table(headers, out, [False] + [True] * (len(headers) - 1))


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """(d)'s completed requests per second over each other arm's, round by round."""
    by = {(r["arm"], r.get("round", 1)): r for r in rows if r["ok"]}
    lines = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        if arm == "d":
            continue
        ratios = [by[("d", rnd)]["requests_per_s"] / by[(arm, rnd)]["requests_per_s"]
                  for (a, rnd) in by if a == arm and ("d", rnd) in by
                  and by[(arm, rnd)]["requests_per_s"] > 0]
        if ratios:
            lines.append(f"(d) / ({arm}) requests per second, by round: "
                         + ", ".join(f"{x:.3f}" for x in ratios)
                         + f" (min {min(ratios):.3f}, median {statistics.median(ratios):.3f})")
    return lines


def default_thunderagent_src() -> Path | None:
    env = os.environ.get("MORI_THUNDERAGENT_SRC")
    candidates = [Path(env)] if env else []
    candidates += [ROOT / "shared" / "peers" / "thunderagent",
                   ROOT.parent / "shared" / "peers" / "thunderagent"]
    return next((c for c in candidates if (c / "pyproject.toml").exists()), None)


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # so that each arm's finally stops its processes


SETTINGS: dict[str, dict[str, Any]] = {
    # tool-bound: 8 programs, tool gaps at a tenth; the engine is mostly idle
    "default": {"programs": 8, "duration": 600.0, "time_scale": 10.0, "blocks": 128,
                "cpu_blocks": "256"},
    # engine-bound: more programs than the pool holds, tool gaps at a hundredth, so that
    # plain vLLM always has requests queued; a host tier twice the pool and one no larger
    "bottleneck": {"programs": 32, "duration": 6000.0, "time_scale": 100.0, "blocks": 256,
                   "cpu_blocks": "512,256"},
}


def parse_cpu_blocks(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 0 for n in sizes):
        raise argparse.ArgumentTypeError(f"expected block counts >= 0 separated by commas, "
                                         f"got {text!r}")
    return sizes


def split_cpus(spec: str) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """``--engine-cpus``: (the engine's CPUs, everything else's), or (None, None) to share.

    ``auto``: with two or more CPUs, the engine gets the last and the rest (the gateway,
    ThunderAgent, the replay client) the others, as a GPU's compute is not the host's;
    ``none``: everything shares every CPU; else a list like ``0`` or ``2,3``."""
    have = frozenset(os.sched_getaffinity(0))
    if spec == "none" or (spec == "auto" and len(have) < 2):
        return None, None
    if spec == "auto":
        engine = frozenset({max(have)})
    else:
        try:
            engine = frozenset(int(x) for x in spec.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"--engine-cpus: expected auto, none or CPU ids "
                                             f"like 0,1; got {spec!r}") from None
    rest = have - engine
    if not engine or not engine <= have or not rest:
        raise argparse.ArgumentTypeError(f"--engine-cpus {spec}: the engine needs CPUs of "
                                         f"{sorted(have)} and must leave at least one")
    return engine, rest


FLAG_VALUED = ("--mori-args",)
"""Options whose value is itself flags (``--mori-args '--fill-idle'``)."""


def glue_flag_values(argv: list[str]) -> list[str]:
    """``argv`` with each option of ``FLAG_VALUED`` joined to its value
    (``--mori-args=--fill-idle``): argparse would take a separate value that starts with
    ``-`` for an option of its own and say the option has no value."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in FLAG_VALUED and i + 1 < len(argv):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="default",
                    help="named defaults for the flags below: 'default' (8 programs, tool-"
                         "bound) or 'bottleneck' (32 programs at time scale 100 on a 256-"
                         "block pool, host tiers of 512 and 256 blocks: the engine is the "
                         "bottleneck); flags given win (default: default)")
    ap.add_argument("--programs", type=int, default=None, help="concurrent programs")
    ap.add_argument("--duration", type=float, default=None,
                    help="simulated seconds per arm (wall: / --time-scale)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="simulated seconds per wall second")
    ap.add_argument("--token-scale", type=float, default=0.01,
                    help="engine tokens per trace token (default 0.01)")
    ap.add_argument("--blocks", type=int, default=None,
                    help="KV blocks of 32 tokens in the engine's pool")
    ap.add_argument("--cpu-blocks", type=parse_cpu_blocks, default=None,
                    help="blocks of 32 tokens in every arm's host KV tier, 0: none; several, "
                         "separated by commas, run every arm at each size")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of all arms, alternating (a b c d, a b c d, ...), so that "
                         "drift of the shared machine falls on every arm (default 1)")
    ap.add_argument("--engine-cpus", default="auto",
                    help="CPUs the engine runs on, the rest running the fronts and the "
                         "replay client: 'auto' (the last CPU, with two or more), 'none' "
                         "(all share all), or ids like 0 or 2,3 (default: auto)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="a,b,c,d", help="arms to run, from a,b,c,d")
    ap.add_argument("--traces", type=Path, default=None,
                    help="trace set (default: the shipped one `mori replay` uses)")
    ap.add_argument("--thunderagent-src", type=Path, default=None,
                    help="ThunderAgent's source tree (default: $MORI_THUNDERAGENT_SRC or "
                         "shared/peers/thunderagent beside or inside the checkout)")
    ap.add_argument("--logs", type=Path, default=None,
                    help="folder for the processes' logs (default: a new temporary one)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--mori-args", default="", metavar="'FLAGS'",
                    help="more flags for mori serve in arms (c) and (d), one string, e.g. "
                         "'--no-learn-costs --no-fill-idle'")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                    help="first time the engine as bench/calibrate_cpu_engine.py does (one "
                         "engine like the arms', about 2 minutes): mori serve is told the "
                         "recompute and reload rates it measured, the results record it "
                         "and bench/sim_fidelity.py simulates with it; the same engine "
                         "runs several times slower on some days than on others "
                         "(default: on; --no-calibrate: the preset's constants)")
    args = ap.parse_args(glue_flag_values(sys.argv[1:] if argv is None else argv))
    named = SETTINGS[args.setting]
    for key in ("programs", "duration", "time_scale", "blocks"):
        if getattr(args, key) is None:
            setattr(args, key, named[key])
    if args.cpu_blocks is None:
        args.cpu_blocks = parse_cpu_blocks(named["cpu_blocks"])
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        ap.error(f"--arms takes letters from a,b,c,d (got {args.arms!r})")
    if args.blocks < 8 or args.programs < 1 or not args.token_scale > 0 or \
            not args.time_scale > 0 or not args.duration > 0 or args.rounds < 1:
        ap.error("--blocks >= 8, --programs >= 1, --rounds >= 1, and positive scales "
                 "and duration, please")
    try:
        engine_cpus, front_cpus = split_cpus(args.engine_cpus)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if front_cpus:
        os.sched_setaffinity(0, front_cpus)  # the fronts started from here inherit it
    traces = load_traces(args.traces) if args.traces else default_traces()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-vllm-agents-"))
    logs.mkdir(parents=True, exist_ok=True)
    ta_src = args.thunderagent_src or default_thunderagent_src()
    signal.signal(signal.SIGTERM, _sigterm)
    print(f"{len(arms)} arm(s) x {args.rounds} round(s) x host tier(s) "
          f"{'/'.join(map(str, args.cpu_blocks))} blocks, {args.programs} programs of "
          f"{traces.name!r}, {args.duration:g} simulated s at time scale "
          f"{args.time_scale:g}, token scale {args.token_scale:g}, {args.blocks} blocks x "
          f"{BLOCK_SIZE} tokens; engine on CPUs "
          f"{'all' if engine_cpus is None else sorted(engine_cpus)}, the rest on "
          f"{'all' if front_cpus is None else sorted(front_cpus)}; logs in {logs}",
          file=sys.stderr)
    rows = []
    measured: dict[str, Any] | None = None
    try:
        if args.calibrate:
            measured = calibrate(args.blocks, engine_cpus, host_tier=max(args.cpu_blocks) > 0)
        calibration = (EngineCalibration.from_mapping(measured["constants"])
                       if measured is not None else None)
        for cpu_blocks in args.cpu_blocks:
            settings = Settings(args.programs, args.duration, args.time_scale,
                                args.token_scale, args.blocks, args.seed, cpu_blocks,
                                engine_cpus, tuple(shlex.split(args.mori_args)), calibration)
            for rnd in range(args.rounds):
                for arm in arms:
                    print(f"host tier {cpu_blocks}, round {rnd + 1}/{args.rounds}: arm "
                          f"({arm}) {ARMS[arm]} ...", file=sys.stderr, flush=True)
                    run_logs = logs / f"cpu{cpu_blocks}-r{rnd + 1}"
                    run_logs.mkdir(exist_ok=True)
                    row = run_arm(arm, settings, traces, run_logs, ta_src)
                    row.update(cpu_blocks=cpu_blocks, round=rnd + 1)
                    rows.append(row)
                    print(f"arm ({arm}) {'done' if row['ok'] else 'FAILED'} in "
                          f"{row['arm_wall_s']:.0f} s", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # the running arm has stopped its processes
        print("interrupted", file=sys.stderr)
        return 130
    for cpu_blocks in args.cpu_blocks:
        these = [r for r in rows if r["cpu_blocks"] == cpu_blocks]
        print(f"\nhost tier {cpu_blocks} blocks ({cpu_blocks * BLOCK_SIZE:,} tokens; the "
              f"pool {args.blocks * BLOCK_SIZE:,}), every run:")
        print(table(these))
        if args.rounds > 1:
            print("\nmedian [min - max] over the rounds:")
        print(summary_table(these))
        for line in verdict(these):
            print(line)
        for r in these:
            said = latency_line(r) if r["ok"] else None
            if said:
                print(said)
    for r in rows:
        if not r["ok"]:
            print(f"({r['arm']}, host tier {r['cpu_blocks']}, round {r['round']}) failed: "
                  f"{r['reason']}")
        elif r.get("note"):
            print(f"({r['arm']}, host tier {r['cpu_blocks']}, round {r['round']}) note: "
                  f"{r['note']}")
    ok = [r for r in rows if r["ok"]]
    if ok:
        r = ok[0]
        print(f"engine tokens per replay text token {r['engine_tokens_per_text_token']}, "
              f"replay token scale {r['replay_token_scale']:.5f}, programs cut at "
              f"{r['max_context']:,} trace tokens (max_model_len {r['max_model_len']})")
    if args.json is not None:
        doc = {"settings": {"programs": args.programs, "duration_s": args.duration,
                            "time_scale": args.time_scale, "token_scale": args.token_scale,
                            "blocks": args.blocks, "seed": args.seed,
                            "cpu_blocks": args.cpu_blocks[0], "cpu_blocks_runs": args.cpu_blocks,
                            "rounds": args.rounds, "setting": args.setting,
                            "engine_cpus": None if engine_cpus is None else sorted(engine_cpus),
                            "mori_args": args.mori_args,
                            # mori serve hands the policy its engine's waiting count
                            # (Policy.set_engine_queues); runs before it did not
                            "mori_reads_engine_queues": True,
                            "front_cpus": None if front_cpus is None else sorted(front_cpus),
                            "traces": traces.name, "block_size": BLOCK_SIZE, "arms": arms,
                            "policy_rates": dict(zip(("recompute_tok_s", "reload_gbps"),
                                                     policy_rates(args.time_scale,
                                                                  calibration),
                                                     strict=True)),
                            "calibration": measured},
               "arms": rows}
        args.json.write_text(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n",
                             encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
