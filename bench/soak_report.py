"""What ``bench_soak.py`` counts and how it prints it: the run's tallies (``Stats``), RSS
samples (``Sample``), Prometheus sums, and the report."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Stats:
    sent: int = 0  # HTTP attempts at chat completions, retries included
    completed: int = 0
    retries: Counter[int] = field(default_factory=Counter)  # 429/503 with Retry-After
    errors: Counter[str] = field(default_factory=Counter)  # "http 500", "ClientOSError", ...
    error_samples: list[str] = field(default_factory=list)
    gave_up_at_end: int = 0  # retries the deadline cut short
    latencies: list[float] = field(default_factory=list)
    programs_started: int = 0
    programs_finished: int = 0
    released: int = 0
    release_errors: Counter[str] = field(default_factory=Counter)
    never_released: int = 0  # never-release programs (finished or cut), left to the TTL
    cut_at_end: int = 0  # programs still running at the deadline

    def error(self, key: str, detail: str) -> None:
        self.errors[key] += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(f"{key}: {detail[:300]}")


@dataclass
class Sample:
    t: float
    rss_mb: float | None
    listed: int | None
    completed: int


def serve_flag(args: list[str], name: str) -> str | None:
    """The value of ``--name`` in a list of serve flags (last one wins)."""
    val = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


def metric_sum(text: str, name: str) -> dict[str, float]:
    """Prometheus samples whose name is ``name`` (labels kept as the key)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            if key == name or key.startswith(name + "{"):
                with contextlib.suppress(ValueError):
                    out[key] = float(val)
    return out


def report(res: dict[str, Any], table_rows: int) -> None:
    lat, p = res["latency_s"], res["programs"]
    print(f"wall {res['wall_s']:.1f} s (+{res['drain_s']:.1f} s draining in-flight requests)")
    print(f"requests: sent {res['sent']} (attempts, retries included), "
          f"completed {res['completed']} "
          f"({res['completed_per_s']:.1f}/s), errors {res['errors_total']} "
          f"{res['errors'] or ''}, retries {sum(res['retries'].values())} "
          f"{res['retries'] or ''}, retries cut by the end {res['gave_up_at_end']}")
    for e in res["error_samples"][:10]:
        print(f"  error sample: {e}")
    print(f"latency (completed, s): p50 {lat['p50']:.3f}  p90 {lat['p90']:.3f}  "
          f"p99 {lat['p99']:.3f}  max {lat['max']:.3f}  mean {lat['mean']:.3f}")
    print(f"programs: started {p['started']}, finished all steps {p['finished']}, "
          f"cut at the end {p['cut_at_end']}, released by client {p['released']} "
          f"{p['release_errors'] or ''}, never-release (left to the TTL) "
          f"{p['never_released']}, "
          f"released by TTL ({p['ttl_s']:g} s, serve log) {p['ttl_released_log_lines']}")
    print(f"gateway lists {p['listed_at_end']} programs at the end"
          + (f", {p['listed_after_ttl']} after the TTL" if p["listed_after_ttl"] is not None
             else ""))
    rows = res["rss_mb"]
    step = max(1, math.ceil(len(rows) / table_rows))
    shown = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    print("   t (s)  RSS (MB)  programs listed  completed")
    for r in shown:
        rss = f"{r['rss_mb']:.1f}" if r["rss_mb"] is not None else "?"
        listed = r["listed"] if r["listed"] is not None else "?"
        print(f"{r['t']:8.1f}  {rss:>8}  {listed:>15}  {r['completed']:>9}")
    verdict = "levels off" if res["rss_levels_off"] else "still GROWING"
    print(f"RSS: last third's mean vs middle third's: {res['rss_growth_pct']:+.1f}% "
          f"({verdict})")
    g = res["gateway_metrics"]
    print(f"gateway metrics: requests {g['mori_requests_total']}, gated "
          f"{g['mori_gated_requests_total']}, upstream errors "
          f"{g['mori_upstream_errors_total'] or 0}, client disconnects "
          f"{g['mori_client_disconnects_total']}")
    print(f"serve log: {res['serve_warning_count']} warning/error lines; serve alive at end: "
          f"{res['serve_alive']}")
    for ln in res["serve_warnings"][:10]:
        print(f"  {ln}")
