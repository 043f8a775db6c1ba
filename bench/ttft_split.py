"""Where a request's time to first token goes, from the engine's and the gateway's TTFT
histograms (``bench/bench_vllm_agents.py`` reads them around each arm): the engine's own,
held at the gateway, the gateway's path besides, the client's hops. Means over what each
histogram counted, so approximate: the client's and the gateway's request sets differ at
the window's ends, and a part can come out negative."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.vllm_arms import http_get
from mori.engines.http import parse_prometheus

TIMERS = {  # histograms whose mean over an arm is read from their _sum and _count
    "engine_ttft": "vllm:time_to_first_token_seconds",  # from the engine's own arrival
    "gateway_ttft": "mori_ttft_seconds",  # from the gateway's arrival (arms c and d)
    "gateway_held": "mori_held_seconds",  # held at the gateway (arms c and d)
}


def timer_sums(url: str, names: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram of ``TIMERS`` named in ``names`` as ``url``'s
    ``/metrics`` reports them now (summed over label sets; absent: not there)."""
    status, text = http_get(url + "/metrics", timeout=10.0)
    if status != 200:
        return {}
    samples = parse_prometheus(text)
    out = {}
    for key in names:
        name = TIMERS[key]
        if name + "_count" in samples:
            out[key] = (sum(v for _, v in samples.get(name + "_sum", [])),
                        sum(v for _, v in samples[name + "_count"]))
    return out


def timer_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
                ) -> dict[str, float | None]:
    """Each timer's mean over what it counted between the two readings, in seconds."""
    out: dict[str, float | None] = {}
    for key, (total, count) in after.items():
        t0, c0 = before.get(key, (0.0, 0.0))
        out[key] = (total - t0) / (count - c0) if count > c0 else None
    return out


def latency_split(client_ttft_s: float | None, timers: dict[str, float | None]
                  ) -> dict[str, Any]:
    """Where a request's mean time to first token went, in wall milliseconds: the
    engine's own (from its API server's arrival), held at the gateway, the gateway's
    path besides (its /tokenize call, the policy, the forward), and the client's hops."""
    def ms(v: float | None) -> float | None:
        return None if v is None or math.isnan(v) else round(1000.0 * v, 2)

    engine, gateway, held = (timers.get(k) for k in ("engine_ttft", "gateway_ttft",
                                                     "gateway_held"))
    split: dict[str, Any] = {"ttft_mean_ms": ms(client_ttft_s), "engine_ttft_mean_ms": ms(engine)}
    if client_ttft_s is None or engine is None:
        return split
    if gateway is not None:
        split["gateway_held_mean_ms"] = ms(held)
        split["gateway_path_mean_ms"] = ms(gateway - engine - (held or 0.0))
        split["client_hop_mean_ms"] = ms(client_ttft_s - gateway)
    else:
        split["client_hop_mean_ms"] = ms(client_ttft_s - engine)
    return split


def latency_line(row: dict[str, Any]) -> str | None:
    """One line: where the arm's mean time to first token went (``latency_split``)."""
    total = row.get("ttft_mean_ms")
    if total is None or row.get("engine_ttft_mean_ms") is None:
        return None
    parts = [("engine", "engine_ttft_mean_ms"), ("held at the gateway", "gateway_held_mean_ms"),
             ("gateway path", "gateway_path_mean_ms"), ("client hops", "client_hop_mean_ms")]
    said = " + ".join(f"{label} {row[key]:,.1f}" for label, key in parts
                      if row.get(key) is not None)
    return f"({row['arm']}, round {row['round']}) TTFT mean {total:,.1f} ms = {said}"
