"""Calibrate the ``cpu-tiny-llama`` preset: prefill and decode times of vLLM's CPU build.

    python bench/calibrate_cpu_engine.py [--sizes 64,512,1024,2048,3500] [--reps 3]
        [--blocks 128] [--engine-cpus auto] [--reload] [--json FILE]

Starts one engine as the real-engine benchmark does (``scripts/start_vllm_cpu.sh``, the
tiny random-weight model, ``--blocks`` blocks of 32 tokens, no MORI plug-in, no host
tier), then times plain HTTP POSTs to ``/v1/completions`` (model ``tiny``, temperature
0, ``ignore_eos``), each a fresh prompt of random three-letter words, so that nothing is
served from the prefix cache (the cache is also reset before each request):

- prefill: a prompt of about N tokens with ``max_tokens`` 1, for each N of ``--sizes``
  (the x value is the engine's own ``usage.prompt_tokens``);
- decode: a prompt of about 200 tokens with ``max_tokens`` 1 and 64; the difference over
  63 is one decode step of one running request.

Each figure is the median of ``--reps`` requests, after two warm-up requests. Fits:
prefill seconds = a + b x tokens (least squares over the sizes; a quadratic fit is
printed too, as attention makes long prefills superlinear) and decode seconds per step
= c. Then the preset constants that reproduce them: ``tau`` (per-iteration overhead)
is the decode step less its (tiny) weight and KV read; the linear and attention FLOP
rates and ``request_overhead_s`` (a fixed time per request beyond its tokens' compute:
HTTP, tokenization, the output path, which the decode step's difference cancels) are
fitted to the prefill times less ``tau`` (non-negative least squares over the cost
model's own prefill terms, chunks of 2,048 tokens included, and a constant); the
effective FLOP/s is the larger of the two rates, so that one efficiency is 1 and the
other below. With ``--reload``, the host tier's copy rate is fitted to the reload
timings too (``copy_bandwidth``). The modelled times are checked with
:class:`~mori.core.costmodel.CostModel` directly.

The engine runs in its own process group, stopped at the end (on failure too). Needs the
vLLM CPU venv and the tiny model (``scripts/vllm_cpu_env.sh``,
``scripts/make_tiny_model.py``); run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.bench_vllm_agents import split_cpus  # noqa: E402
from bench.benchutil import free_port  # noqa: E402
from bench.vllm_arms import block_bytes, pinned_to, stop_group  # noqa: E402
from mori.cli.table import format_table  # noqa: E402
from mori.core.calibration import EngineCalibration  # noqa: E402
from mori.core.costmodel import CostModel, get_preset, prefill_attn_ctx  # noqa: E402
from mori.core.hardware import HardwarePreset  # noqa: E402
from mori.core.linear import solve  # noqa: E402

CACHE = Path(os.environ.get("MORI_CACHE", Path.home() / ".cache" / "mori"))
MODEL = CACHE / "tiny-llama"
PRESET = "cpu-tiny-llama"
ENGINE_START_S = 300.0
DECODE_PROMPT = 200
DECODE_LONG = 64
NOMINAL_MEM_BW = 20e9  # bytes/s: a CPU's DRAM; weights and KV of the tiny model are small
ATTN_FLOOR = 0.01  # attention keeps at least this share of the 2,048-token prefill work


# -- the engine ---------------------------------------------------------------------------
def start_engine(blocks: int, log: Path, cpu_gib: float = 0.0,
                 cpus: frozenset[int] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """The engine process (its own process group) and its base URL, once it is healthy;
    ``cpu_gib`` > 0 gives it a host KV tier of that size; ``cpus``: the CPUs it runs on
    (its compute threads bound to them), as the benchmark pins it."""
    port, kv_port = free_port(), free_port()
    env = {**os.environ, "MORI_PYTHON": sys.executable, "MORI_VLLM_PLUGIN": "0"}
    env.pop("MORI_VLLM_CPU_GIB", None)
    if cpu_gib > 0:
        env["MORI_VLLM_CPU_GIB"] = repr(cpu_gib)
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))

    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "start_vllm_cpu.sh"), str(MODEL), str(port),
             str(kv_port), str(blocks)],
            stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT,
            preexec_fn=pinned_to(cpus))
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while get_status(url + "/health") != 200:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with status {proc.returncode}; see {log}")
        if time.monotonic() - t0 > ENGINE_START_S:
            raise RuntimeError(f"the engine did not start within {ENGINE_START_S:.0f} s; "
                               f"see {log}")
        time.sleep(0.5)
    return proc, url


def get_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0
         ) -> dict[str, Any]:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read()
    out: dict[str, Any] = json.loads(text) if text.strip() else {}
    return out


# -- prompts and timings ------------------------------------------------------------------
class Prompts:
    """Fresh prompts of random three-letter words, sized with the engine's ``/tokenize``."""

    def __init__(self, url: str, seed: int = 11) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.vocab = ["".join(self.rng.choices(string.ascii_lowercase, k=3))
                      for _ in range(4096)]
        sample = self.words(2000)
        self.tokens_per_word = self.count(sample) / 2000

    def words(self, n: int) -> str:
        return " ".join(self.rng.choices(self.vocab, k=n))

    def count(self, text: str) -> int:
        out = post(self.url + "/tokenize", {"model": "tiny", "prompt": text})
        return int(out["count"])

    def of(self, tokens: int) -> str:
        """A new prompt of about ``tokens`` tokens (special tokens included)."""
        text = self.words(max(1, round(tokens / self.tokens_per_word)))
        for _ in range(3):  # trim or extend toward the target
            n = self.count(text)
            if abs(n - tokens) <= 2:
                break
            words = text.split()
            change = round((tokens - n) / self.tokens_per_word)
            text = (" ".join(words[:change]) if change < 0 else
                    text + " " + self.words(max(1, change)))
        return text


def timed_completion(url: str, prompt: str, max_tokens: int) -> tuple[int, int, float]:
    """(prompt tokens, completion tokens, wall seconds) of one request, cache reset before."""
    with contextlib.suppress(urllib.error.URLError, OSError):
        post(url + "/reset_prefix_cache")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    out = post(url + "/v1/completions", body)
    dt = time.perf_counter() - t0
    usage = out["usage"]
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"]), dt


def measure_prefill(url: str, prompts: Prompts, sizes: list[int], reps: int
                    ) -> list[tuple[int, float]]:
    """(prompt tokens, median seconds) per size, ``max_tokens`` 1."""
    out = []
    for size in sizes:
        runs = [timed_completion(url, prompts.of(size), 1) for _ in range(reps)]
        tokens = round(statistics.median(r[0] for r in runs))
        out.append((tokens, statistics.median(r[2] for r in runs)))
        print(f"prefill {tokens:5d} tokens: {1e3 * out[-1][1]:8.1f} ms "
              f"({', '.join(f'{1e3 * r[2]:.1f}' for r in runs)})", file=sys.stderr)
    return out


def measure_decode(url: str, prompts: Prompts, reps: int) -> float:
    """Seconds per decode step of one running request (about 200 tokens of context)."""
    steps = []
    for _ in range(reps):
        _, _, short = timed_completion(url, prompts.of(DECODE_PROMPT), 1)
        _, n, long = timed_completion(url, prompts.of(DECODE_PROMPT), DECODE_LONG)
        steps.append((long - short) / max(1, n - 1))
    step = statistics.median(steps)
    print(f"decode step: {1e3 * step:.2f} ms ({', '.join(f'{1e3 * s:.2f}' for s in steps)})",
          file=sys.stderr)
    return step


def external_hits(url: str) -> float:
    """The engine's ``vllm:external_prefix_cache_hits_total`` (tokens from the host tier)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10.0) as r:
        text = r.read().decode("utf-8", "replace")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total"))


def measure_reload(url: str, prompts: Prompts, size: int, pool_tokens: int, reps: int
                   ) -> tuple[float, float, float]:
    """(median seconds of a fresh prefill of ``size`` tokens, median seconds of the same
    prompt again once fresh prompts have pushed it out of the GPU pool, so that it is
    served from the host tier, the share of its tokens the host tier served)."""
    fresh, again, served = [], [], []
    for _ in range(reps):
        prompt = prompts.of(size)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        out = post(url + "/v1/completions", body)
        fresh.append(time.perf_counter() - t0)
        tokens = int(out["usage"]["prompt_tokens"])
        for _ in range(2 * pool_tokens // size + 1):  # push it out of the GPU pool
            post(url + "/v1/completions", {**body, "prompt": prompts.of(size)})
        before = external_hits(url)
        t0 = time.perf_counter()
        post(url + "/v1/completions", body)
        again.append(time.perf_counter() - t0)
        served.append((external_hits(url) - before) / tokens)
    print(f"prompt of {size} tokens: fresh {1e3 * statistics.median(fresh):.1f} ms, from the "
          f"host tier {1e3 * statistics.median(again):.1f} ms ({statistics.median(served):.0%} "
          f"of it served from there)", file=sys.stderr)
    return statistics.median(fresh), statistics.median(again), statistics.median(served)


# -- fits -----------------------------------------------------------------------------------
def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a + b x."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def fit_quadratic(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares a + b x + q x^2 (the normal equations, by Cramer's rule)."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    s = [sum(x ** k for x in xs) for k in range(5)]
    t = [sum(y * x ** k for x, y in zip(xs, ys, strict=True)) for k in range(3)]
    m = [[s[0], s[1], s[2]], [s[1], s[2], s[3]], [s[2], s[3], s[4]]]

    def det(a: list[list[float]]) -> float:
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))

    d = det(m)
    coef = []
    for col in range(3):
        mc = [row[:col] + [t[i]] + row[col + 1:] for i, row in enumerate(m)]
        coef.append(det(mc) / d)
    return coef[0], coef[1], coef[2]


def prefill_terms(preset: HardwarePreset, tokens: int) -> tuple[int, float, float]:
    """The cost model's prefill of ``tokens`` new tokens in chunks: (iterations, linear
    token count, attention units = sum of attended context)."""
    chunk, done, iters, attn = preset.chunk_size, 0, 0, 0.0
    while done < tokens:
        n = min(chunk, tokens - done)
        attn += n * done + n * n / 2
        done += n
        iters += 1
    return iters, float(tokens), attn


def _nnls(rows: Sequence[tuple[float, ...]], ys: list[float]) -> list[float]:
    """Least squares ``y = sum_j x_j row_j`` with every ``x_j >= 0``: the best of the
    unconstrained fits over each subset of the columns whose solution is non-negative
    (the columns are few)."""
    k = len(rows[0])
    best: tuple[float, list[float]] = (
        sum(y * y for y in ys), [0.0] * k)
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        ata = [[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
        aty = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in cols]
        sol = solve(ata, aty)
        if sol is None or min(sol) < 0:
            continue
        x = [0.0] * k
        for j, v in zip(cols, sol, strict=True):
            x[j] = v
        sse = sum((y - sum(xj * rj for xj, rj in zip(x, r, strict=True))) ** 2
                  for r, y in zip(rows, ys, strict=True))
        if sse < best[0]:
            best = (sse, x)
    return best[1]


def _prefill_rates(base: HardwarePreset, points: list[tuple[int, float]], tau: float
                   ) -> tuple[float, float, float]:
    """Seconds per linear token, per attention unit, and per request (the fixed
    overhead beyond the tokens' compute) that fit the prefill times less ``tau`` per
    iteration; attention keeps a floor (the model cannot make it free)."""
    rows, ys = [], []
    for tokens, seconds in points:
        iters, lin, attn = prefill_terms(base, tokens)
        rows.append((lin, attn, 1.0))
        ys.append(seconds - iters * tau)
    s_lin, s_attn, overhead = _nnls(rows, ys)
    _, lin2k, attn2k = prefill_terms(base, base.chunk_size)
    floor = ATTN_FLOOR * (s_lin * lin2k + s_attn * attn2k) / attn2k
    if s_attn < floor:
        s_lin, s_attn = max(s_lin - (floor - s_attn) * attn2k / lin2k, 1e-12), floor
    return max(s_lin, 1e-12), s_attn, overhead


def preset_constants(points: list[tuple[int, float]], step: float) -> dict[str, float]:
    """tau, flops, eta_gemm, eta_attn, mem_bw, eta_mem and request_overhead_s that
    reproduce the timings.

    A decode step is ``tau`` plus the larger of one token's linear work and the weight and
    KV read, so ``tau`` and the prefill rates are fitted in turn until they agree.
    """
    base = get_preset(PRESET)
    m = base.model
    decode_read = (m.weight_bytes + m.kv_bytes_per_token * DECODE_PROMPT) / NOMINAL_MEM_BW
    s_lin = 0.0
    for _ in range(20):
        tau = max(0.0, step - max(decode_read, s_lin))
        s_lin, s_attn, overhead = _prefill_rates(base, points, tau)
    lin_rate = m.linear_flops_per_token / s_lin  # effective FLOP/s of each kind
    attn_rate = m.attn_flops_per_token_per_ctx / s_attn
    flops = max(lin_rate, attn_rate)
    return {"tau": tau, "flops": flops, "eta_gemm": lin_rate / flops,
            "eta_attn": attn_rate / flops, "mem_bw": NOMINAL_MEM_BW, "eta_mem": 1.0,
            "request_overhead_s": overhead}


def copy_bandwidth(c: dict[str, float], reloads: list[dict[str, float]]) -> float | None:
    """The host-to-engine copy rate (bytes/s) that fits the reload timings: each one's
    time less the request overhead and the one-token iteration that follows the copy is
    the copy (least squares through the origin over the bytes copied); None if no
    reload was timed or the fit is not positive."""
    cost = CostModel(calibrated_preset(c))
    kv = cost.preset.kv_bytes_per_token_per_gpu
    sbb = sby = 0.0
    for r in reloads:
        tokens = int(r["tokens"])
        rest = modelled_reload(cost, tokens, 0.0)  # all but the copy
        copied = tokens * kv * float(r["host_tier_share"])
        sbb += copied * copied
        sby += copied * (float(r["host_tier_s"]) - rest)
    if sbb <= 0 or sby <= 0:
        return None
    return sbb / sby


def modelled_reload(cost: CostModel, tokens: int, share: float) -> float:
    """One request served from the host tier, as the model times it: the request
    overhead, the copy of ``share`` of its tokens, and one token computed."""
    return (cost.request_overhead + cost.reload_time(round(tokens * share))
            + cost.iteration_time(1, prefill_attn_ctx(1, tokens - 1), 0, 0))


def calibrated_preset(c: dict[str, float]) -> HardwarePreset:
    return EngineCalibration.from_mapping(c).applied_to(get_preset(PRESET))


def modelled_prefill(cost: CostModel, tokens: int) -> float:
    """The cost model's prefill of ``tokens`` fresh tokens, chunk by chunk, with the
    request overhead: one request's time, as measured."""
    return cost.request_overhead + cost.prefill_time(tokens)


def report(points: list[tuple[int, float]], a: float, b: float, step: float,
           c: dict[str, float]) -> str:
    cost = CostModel(calibrated_preset(c))
    rows = []
    for tokens, seconds in points:
        model = modelled_prefill(cost, tokens)
        rows.append([f"prefill {tokens}", f"{1e3 * seconds:.1f}", f"{1e3 * (a + b * tokens):.1f}",
                     f"{1e3 * model:.1f}", f"{model / seconds - 1:+.0%}"])
    model_step = cost.decode_run_time(1, DECODE_PROMPT, 1)
    rows.append(["decode step", f"{1e3 * step:.2f}", f"{1e3 * step:.2f}",
                 f"{1e3 * model_step:.2f}", f"{model_step / step - 1:+.0%}"])
    return format_table(("what", "measured ms", "line fit ms", "model ms", "model vs measured"),
                        rows,
                        (False, True, True, True, True))


@dataclasses.dataclass(frozen=True)
class Measured:
    """One calibration's timings: ``points`` (prompt tokens, prefill seconds), the decode
    ``step``, the ``reloads`` from the host tier and the ``tokenize`` points (prompt
    tokens, seconds of one ``/tokenize`` call: what a gateway's exact token count costs
    the engine's API server)."""

    points: list[tuple[int, float]]
    step: float
    reloads: list[dict[str, float]]
    tokenize: list[tuple[int, float]]


def measure_tokenize(url: str, prompts: Prompts, sizes: list[int], reps: int
                     ) -> list[tuple[int, float]]:
    """(prompt tokens, median seconds) of ``/tokenize`` calls per size."""
    out = []
    for size in sizes:
        text, times, count = prompts.of(size), [], 0
        for _ in range(reps + 1):  # the first call warms the path
            t0 = time.perf_counter()
            count = prompts.count(text)
            times.append(time.perf_counter() - t0)
        out.append((count, statistics.median(times[1:])))
    print("tokenize: " + ", ".join(f"{n} tokens {1e3 * t:.2f} ms" for n, t in out),
          file=sys.stderr)
    return out


def measure(blocks: int, cpus: frozenset[int] | None, sizes: list[int], reps: int, *,
            host_tier: bool, one_engine: bool = False) -> Measured:
    """Prefill points, the decode step and (``host_tier``) reload timings of an engine of
    ``blocks`` blocks on ``cpus``. The prefill and decode are timed on an engine without
    a host tier, the reloads on one with a host tier four times the pool; with
    ``one_engine``, all on the latter (as an engine with a write-through host tier
    prefills: what the benchmark's arms run)."""
    log = Path(tempfile.mkdtemp(prefix="calibrate-cpu-engine-")) / "vllm.log"
    tier_gib = 4 * blocks * block_bytes() / (1 << 30)
    reloads: list[dict[str, float]] = []
    proc, url = start_engine(blocks, log, cpu_gib=tier_gib if one_engine else 0.0, cpus=cpus)
    try:
        prompts = Prompts(url)
        for _ in range(2):  # warm-up
            timed_completion(url, prompts.of(256), 8)
        points = measure_prefill(url, prompts, sizes, reps)
        step = measure_decode(url, prompts, reps)
        tokenize = measure_tokenize(url, prompts, sizes, 2 * reps)
        if host_tier and one_engine:
            reloads = measure_reloads(url, prompts, sizes, blocks, reps)
    finally:
        stop_group(proc)
    if host_tier and not one_engine:
        log2 = log.with_name("vllm-host-tier.log")
        # a host tier four times the pool: what was pushed out of the GPU stays there
        proc, url = start_engine(blocks, log2, cpu_gib=tier_gib, cpus=cpus)
        try:
            prompts = Prompts(url)
            for _ in range(2):
                timed_completion(url, prompts.of(256), 8)
            reloads = measure_reloads(url, prompts, sizes, blocks, reps)
        finally:
            stop_group(proc)
    return Measured(points, step, reloads, tokenize)


def measure_reloads(url: str, prompts: Prompts, sizes: list[int], blocks: int, reps: int
                    ) -> list[dict[str, float]]:
    """A reload timing for each of ``sizes`` of at least 512 tokens."""
    out = []
    for size in (s for s in sizes if s >= 512):
        f, r, share = measure_reload(url, prompts, size, (blocks - 1) * 32, reps)
        out.append({"tokens": size, "fresh_s": f, "host_tier_s": r, "host_tier_share": share})
    return out


def tokenize_fit(points: list[tuple[int, float]]) -> dict[str, Any]:
    """A ``/tokenize`` call's seconds as ``fixed_s + per_token_s x tokens`` (least
    squares; a single size: all fixed), with the points."""
    if len(points) >= 2 and len({n for n, _ in points}) >= 2:
        a, b = fit_line(points)
        if b < 0:
            a, b = statistics.fmean(t for _, t in points), 0.0
    else:
        a, b = (points[0][1] if points else 0.0), 0.0
    return {"fixed_s": max(0.0, a), "per_token_s": b, "points": points}


def fitted_constants(points: list[tuple[int, float]], step: float,
                     reloads: list[dict[str, float]]) -> dict[str, float]:
    """The preset constants that reproduce the timings (``copy_bw`` when the reloads
    give one)."""
    constants = preset_constants(points, step)
    copy_bw = copy_bandwidth(constants, reloads)
    if copy_bw is not None:
        constants["copy_bw"] = copy_bw
    return constants


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,512,1024,2048,3500",
                    help="prefill prompt sizes in tokens (default 64,512,1024,2048,3500)")
    ap.add_argument("--reps", type=int, default=3, help="requests per figure (default 3)")
    ap.add_argument("--blocks", type=int, default=128,
                    help="KV blocks of 32 tokens in the engine's pool (default 128)")
    ap.add_argument("--engine-cpus", default="auto",
                    help="CPUs the engine runs on, as bench_vllm_agents.py pins it: 'auto' "
                         "(the last CPU, with two or more; this script on the rest), "
                         "'none' (all), or ids like 0 or 2,3 (default: auto)")
    ap.add_argument("--reload", action="store_true",
                    help="also start an engine with a host KV tier (vLLM's "
                         "OffloadingConnector, as the benchmark runs it) and time a prompt "
                         "served from it against the same prompt computed fresh")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or max(sizes) + 1 > (args.blocks - 1) * 32 or args.reps < 1:
        ap.error("sizes must be positive and fit the pool; --reps >= 1")
    try:
        engine_cpus, rest = split_cpus(args.engine_cpus)
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if rest:
        os.sched_setaffinity(0, rest)
    print(f"engine on CPUs {'all' if engine_cpus is None else sorted(engine_cpus)}",
          file=sys.stderr)
    measured = measure(args.blocks, engine_cpus, sizes, args.reps, host_tier=args.reload)
    points, step, reloads = measured.points, measured.step, measured.reloads
    a, b = fit_line(points)
    qa, qb, qq = fit_quadratic(points) if len(points) >= 3 else (a, b, 0.0)
    constants = fitted_constants(points, step, reloads)
    print(f"fit: prefill seconds = {a:.4f} + {b:.3e} x tokens; decode step = {step:.4f} s")
    print(f"(quadratic: prefill seconds = {qa:.4f} + {qb:.3e} x tokens + {qq:.3e} x tokens^2)")
    print("preset constants: " + ", ".join(f"{k}={v:.4g}" for k, v in constants.items()))
    print(report(points, a, b, step, constants))
    if reloads:
        cost = CostModel(calibrated_preset(constants))
        print(format_table(
            ("prompt tokens", "fresh ms", "from host tier ms", "host tier served",
             "host tier / fresh", "model ms"),
            [[str(r["tokens"]), f"{1e3 * r['fresh_s']:.1f}", f"{1e3 * r['host_tier_s']:.1f}",
              f"{r['host_tier_share']:.0%}", f"{r['host_tier_s'] / r['fresh_s']:.2f}",
              f"{1e3 * modelled_reload(cost, int(r['tokens']), r['host_tier_share']):.1f}"]
             for r in reloads], (True,) * 6))
    if args.json is not None:
        doc = {"prefill": points, "fit": {"a": a, "b": b, "decode_step": step},
               "quadratic_fit": {"a": qa, "b": qb, "q": qq},
               "constants": constants, "reloads": reloads,
               "tokenize": tokenize_fit(measured.tokenize)}
        args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
