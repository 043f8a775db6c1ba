"""Measure, on one GPU, the rates the simulator's cost model prices (docs/costmodel.md):
HBM copy bandwidth, bf16 GEMM throughput over each preset model's linear shapes, attention
over (new, cached) tokens, host-device copies, pinned and not, and whole prefill and
decode steps at the presets' shapes (one layer's linear layers and attention, times the
layer count).

Needs only PyTorch with CUDA (no engine). Prints one table per measurement and writes
every figure as JSON (``--out``); ``docs/costmodel.md`` sets them beside the presets'
efficiencies (``eta_mem``, ``eta_gemm``, ``eta_attn``, ``reload_bw``). Each figure is the
median of ``--reps`` timed runs after a warm-up, timed with CUDA events.

    python bench/calibrate_gpu.py --out calib.json [--reps 20]

Approximations, on purpose: one layer's linear layers are timed as plain GEMMs (no
fused kernels, no quantization); the MoE model's experts as one batched GEMM over the
experts with the routed tokens split evenly; attention is PyTorch's
``scaled_dot_product_attention`` (flash or memory-efficient kernels as PyTorch picks),
causal when nothing is cached, else every new token against the whole context, with
grouped-query heads (``enable_gqa``; repeated on an older PyTorch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

# Per model: hidden size, query heads, KV heads, head dim, and one layer's linear shapes
# (K, N) for the dense part; experts as (count, top-k, hidden, expert MLP width).
MODELS: dict[str, dict[str, Any]] = {
    "Qwen2.5-7B": {"hidden": 3584, "q": 28, "kv": 4, "hd": 128,
                   "linears": [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)]},
    "Qwen3-30B-A3B": {"hidden": 2048, "q": 32, "kv": 4, "hd": 128,
                      "linears": [(2048, 5120), (4096, 2048)],
                      "experts": (128, 8, 2048, 768)},
    "Llama-3.1-70B-TP2": {"hidden": 8192, "q": 32, "kv": 4, "hd": 128,
                          "linears": [(8192, 5120), (4096, 8192), (8192, 28672),
                                      (14336, 8192)]},
}
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
LAYERS = {"Qwen2.5-7B": 28, "Qwen3-30B-A3B": 48, "Llama-3.1-70B-TP2": 80}
PREFILL_STEPS = ((8192, 0), (8192, 32768), (2048, 100_000))  # (new, cached) tokens
DECODE_STEPS = ((16, 8192), (64, 8192), (64, 32768), (256, 8192))  # (batch, context)


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (after two warm-ups)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def hbm(reps: int) -> dict[str, float]:
    n = 2 << 30  # bytes
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a), reps)
    return {"bytes": n, "s": s, "bw": 2 * n / s}  # read + write


def gemms(reps: int) -> list[dict[str, Any]]:
    out = []
    for name, m in MODELS.items():
        for tokens in TOKENS:
            x = {k: torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda")
                 for k, _ in m["linears"]}
            ws = [torch.randn(k, n, dtype=torch.bfloat16, device="cuda") for k, n in m["linears"]]

            def layer(x: dict[int, torch.Tensor] = x, ws: list[torch.Tensor] = ws) -> None:
                for w in ws:
                    torch.matmul(x[w.shape[0]], w)

            s = timed(layer, reps)
            flops = sum(2 * tokens * k * n for k, n in m["linears"])
            weight_bytes = sum(2 * k * n for k, n in m["linears"])
            row = {"model": name, "part": "dense", "tokens": tokens, "s": s,
                   "flops": flops, "weight_bytes": weight_bytes}
            if "experts" in m:
                count, top, hidden, width = m["experts"]
                per = max(1, tokens * top // count)
                xe = torch.randn(count, per, hidden, dtype=torch.bfloat16, device="cuda")
                w1 = torch.randn(count, hidden, 2 * width, dtype=torch.bfloat16, device="cuda")
                w2 = torch.randn(count, width, hidden, dtype=torch.bfloat16, device="cuda")
                he = torch.empty(count, per, width, dtype=torch.bfloat16, device="cuda")

                def experts(xe: torch.Tensor = xe, w1: torch.Tensor = w1,
                            w2: torch.Tensor = w2, he: torch.Tensor = he) -> None:
                    torch.bmm(xe, w1)
                    torch.bmm(he, w2)

                se = timed(experts, reps)
                out.append({"model": name, "part": "experts", "tokens": tokens, "s": se,
                            "flops": 2 * count * per * hidden * 3 * width,
                            "weight_bytes": 2 * count * hidden * 3 * width})
                del xe, w1, w2, he
            out.append(row)
            del x, ws
        torch.cuda.empty_cache()
    return out


def attention(reps: int) -> list[dict[str, Any]]:
    out = []
    f = torch.nn.functional.scaled_dot_product_attention
    for name, m in MODELS.items():
        q_heads, kv_heads, hd = m["q"], m["kv"], m["hd"]
        for new, cached in ((2048, 0), (8192, 0), (2048, 32768), (8192, 32768),
                            (2048, 100_000), (1, 32768), (1, 100_000)):
            ctx = new + cached
            q = torch.randn(1, q_heads, new, hd, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(1, kv_heads, ctx, hd, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            causal = cached == 0 and new > 1
            try:
                f(q, k, v, is_causal=causal, enable_gqa=True)
                gqa = True
            except (TypeError, RuntimeError):  # an older PyTorch: repeat the KV heads
                k = k.repeat_interleave(q_heads // kv_heads, dim=1)
                v = v.repeat_interleave(q_heads // kv_heads, dim=1)
                gqa = False

            def attn(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                     causal: bool = causal, gqa: bool = gqa) -> None:
                if gqa:
                    f(q, k, v, is_causal=causal, enable_gqa=True)
                else:
                    f(q, k, v, is_causal=causal)

            s = timed(attn, reps)
            # (query, key) pairs the kernel computes: causal over the new tokens alone, else
            # every new token against the whole context; 4 * head_dim FLOPs a pair and head
            pairs = new * (new + 1) / 2 if causal else new * ctx
            out.append({"model": name, "new": new, "cached": cached, "s": s, "gqa": gqa,
                        "flops": 4 * hd * q_heads * pairs,
                        "kv_bytes": 2 * 2 * kv_heads * hd * ctx})
            del q, k, v
        torch.cuda.empty_cache()
    return out


def _layer(m: dict[str, Any], tokens: int) -> Callable[[], None]:
    """One layer's linear layers (and routed experts) over ``tokens`` tokens."""
    x = {k: torch.randn(tokens, k, dtype=torch.bfloat16, device="cuda") for k, _ in m["linears"]}
    ws = [torch.randn(k, n, dtype=torch.bfloat16, device="cuda") for k, n in m["linears"]]
    experts: tuple[torch.Tensor, ...] = ()
    if "experts" in m:
        count, top, hidden, width = m["experts"]
        per = max(1, tokens * top // count)
        experts = (torch.randn(count, per, hidden, dtype=torch.bfloat16, device="cuda"),
                   torch.randn(count, hidden, 2 * width, dtype=torch.bfloat16, device="cuda"),
                   torch.randn(count, per, width, dtype=torch.bfloat16, device="cuda"),
                   torch.randn(count, width, hidden, dtype=torch.bfloat16, device="cuda"))

    def run() -> None:
        for w in ws:
            torch.matmul(x[w.shape[0]], w)
        if experts:
            torch.bmm(experts[0], experts[1])
            torch.bmm(experts[2], experts[3])
    return run


def steps(reps: int) -> list[dict[str, Any]]:
    """Whole engine steps at each preset's shapes, as one layer's linear layers and
    attention times the layer count (no norms, rotary, sampling or launch gaps between
    layers: a lower bound of a real step)."""
    out = []
    f = torch.nn.functional.scaled_dot_product_attention
    for name, m in MODELS.items():
        q_heads, kv_heads, hd = m["q"], m["kv"], m["hd"]
        for new, cached in PREFILL_STEPS:
            lin = _layer(m, new)
            q = torch.randn(1, q_heads, new, hd, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(1, kv_heads, new + cached, hd, dtype=torch.bfloat16,
                            device="cuda")
            v = torch.randn_like(k)  # not k again: its tiles would come from the cache
            causal = cached == 0

            def prefill(lin: Callable[[], None] = lin, q: torch.Tensor = q,
                        k: torch.Tensor = k, v: torch.Tensor = v, causal: bool = causal
                        ) -> None:
                lin()
                f(q, k, v, is_causal=causal, enable_gqa=True)

            s = timed(prefill, reps)
            out.append({"model": name, "kind": "prefill", "new": new, "cached": cached,
                        "layer_s": s, "step_s": s * LAYERS[name]})
            del q, k, v, lin
            torch.cuda.empty_cache()
        for batch, ctx in DECODE_STEPS:
            lin = _layer(m, batch)
            q = torch.randn(batch, q_heads, 1, hd, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(batch, kv_heads, ctx, hd, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)

            def decode(lin: Callable[[], None] = lin, q: torch.Tensor = q,
                       k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                lin()
                f(q, k, v, enable_gqa=True)

            s = timed(decode, reps)
            out.append({"model": name, "kind": "decode", "batch": batch, "context": ctx,
                        "layer_s": s, "step_s": s * LAYERS[name]})
            del q, k, v, lin
            torch.cuda.empty_cache()
    return out


def copies(reps: int) -> list[dict[str, Any]]:
    out = []
    for mib in (1, 16, 128, 1024):
        n = mib << 20
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        for pinned in (True, False):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
            h2d = timed(lambda host=host, dev=dev: dev.copy_(host, non_blocking=True), reps)
            d2h = timed(lambda host=host, dev=dev: host.copy_(dev, non_blocking=True), reps)
            out.append({"bytes": n, "pinned": pinned, "h2d_s": h2d, "d2h_s": d2h,
                        "h2d_bw": n / h2d, "d2h_bw": n / d2h})
            del host
        del dev
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for every figure")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("calibrate_gpu: no CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0),
                              "torch": torch.__version__}
    result["hbm"] = h = hbm(args.reps)
    print(f"{result['device']}, torch {result['torch']}")
    print(f"HBM copy: {h['bw'] / 1e12:.2f} TB/s (read + write of {h['bytes'] >> 30} GiB)",
          flush=True)
    result["copies"] = cp = copies(args.reps)
    for r in cp:
        print(f"host copy {r['bytes'] >> 20:5d} MiB {'pinned  ' if r['pinned'] else 'pageable'}"
              f" H2D {r['h2d_bw'] / 1e9:6.1f} GB/s  D2H {r['d2h_bw'] / 1e9:6.1f} GB/s",
              flush=True)
    result["gemm"] = gm = gemms(args.reps)
    for r in gm:
        print(f"GEMM {r['model']:18} {r['part']:7} {r['tokens']:5d} tokens "
              f"{r['s'] * 1e3:8.3f} ms  {r['flops'] / r['s'] / 1e12:6.1f} TFLOP/s  "
              f"{r['weight_bytes'] / r['s'] / 1e12:5.2f} TB/s of weights", flush=True)
    result["attention"] = at = attention(args.reps)
    for r in at:
        print(f"attention {r['model']:18} new {r['new']:5d} cached {r['cached']:6d} "
              f"{r['s'] * 1e3:8.3f} ms  {r['flops'] / r['s'] / 1e12:6.1f} TFLOP/s  "
              f"{r['kv_bytes'] / r['s'] / 1e12:5.2f} TB/s of KV", flush=True)
    result["steps"] = st = steps(args.reps)
    for r in st:
        shape = (f"new {r['new']:5d} cached {r['cached']:6d}" if r["kind"] == "prefill"
                 else f"batch {r['batch']:4d} context {r['context']:6d}")
        print(f"step {r['model']:18} {r['kind']:7} {shape}  layer {r['layer_s'] * 1e3:7.3f} ms"
              f"  x{LAYERS[r['model']]} = {r['step_s'] * 1e3:8.2f} ms", flush=True)
    result["wall_s"] = time.time() - t0
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
