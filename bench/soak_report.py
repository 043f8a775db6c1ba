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
    # retried answers: "429"/"503"/... (with Retry-After), "stream error event"
    retries: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # steps given up: "http 500", ...
    error_samples: list[str] = field(default_factory=list)
    # every answer that was not a 200 ending well, by kind: clean ones (a 5xx or 429 with
    # Retry-After, a stream ended by an error event) and the rest
    clean: Counter[str] = field(default_factory=Counter)
    unclean: Counter[str] = field(default_factory=Counter)
    unclean_samples: list[str] = field(default_factory=list)
    # connection failures while the gateway restarted (retried once it was back)
    restart_retries: Counter[str] = field(default_factory=Counter)
    gave_up_at_end: int = 0  # retries the deadline cut short
    latencies: list[float] = field(default_factory=list)
    programs_started: int = 0
    programs_finished: int = 0
    released: int = 0
    release_errors: Counter[str] = field(default_factory=Counter)
    never_released: int = 0  # never-release programs (finished or cut), left to the TTL
    cut_at_end: int = 0  # programs still running at the deadline

    def error(self, key: str, detail: str) -> None:
        """A step given up (not retried)."""
        self.errors[key] += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(f"{key}: {detail[:300]}")

    def answer(self, kind: str, clean: bool, detail: str, t: float) -> None:
        """A non-200 answer (or a failed 200), classified; ``t``: run seconds."""
        if clean:
            self.clean[kind] += 1
            return
        self.unclean[kind] += 1
        if len(self.unclean_samples) < 20:
            self.unclean_samples.append(f"t={t:.1f} {kind}: {detail[:300]}")


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


def placement(before: dict[str, int | None], after: dict[str, int | None],
              residency: list[dict[str, dict[str, int]]]) -> dict[str, Any]:
    """Where the programs listed before a gateway restart (``before``: id -> replica) came
    back (``after``), judged against the engines' residency (one ``/mori/v1/residency``
    per replica, in order): of the programs that had a replica and whose KV some engine
    still holds, ``kept`` came back at the same replica, ``moved_to_replica_with_kv`` at
    another one that holds their KV, and ``lost`` elsewhere or not at all. Programs an
    engine reports as ended (released before the restart, by a client or by the
    gateway's idle timeout) and not listed after it are counted apart
    (``released_before``): they are not to be taken back."""
    holders: dict[str, set[int]] = {}
    ended: set[str] = set()  # released before the restart (by a client or the idle
    # timeout): the engine may still cache their KV, but they are not taken back
    for res in residency:
        ended.update(str(pid) for pid in res.get("ended") or ())
    for i, res in enumerate(residency):
        for tier in ("gpu_tokens", "cpu_tokens"):
            for pid, n in (res.get(tier) or {}).items():
                if n > 0:
                    holders.setdefault(pid, set()).add(i)
    kept = moved = not_held = no_replica = released = 0
    lost: list[dict[str, Any]] = []
    for pid, r in before.items():
        if r is None:
            no_replica += 1
            continue
        if pid in ended and pid not in after:
            released += 1
            continue
        held = holders.get(pid)
        if not held:
            not_held += 1
            continue
        r2 = after.get(pid)
        if r2 == r:
            kept += 1
        elif r2 is not None and r2 in held:
            moved += 1
        else:
            lost.append({"program_id": pid, "before": r, "after": r2,
                         "listed_after": pid in after, "kv_on": sorted(held)})
    return {"kept": kept, "moved_to_replica_with_kv": moved, "lost": len(lost),
            "lost_samples": lost[:20], "kv_on_no_engine": not_held,
            "no_replica_before": no_replica, "released_before": released,
            "engine_programs": [len(set(res.get("gpu_tokens") or {})
                                    | set(res.get("cpu_tokens") or {}))
                                for res in residency],
            "restored_not_listed_before": sum(1 for pid in after if pid not in before)}


def _s(x: float | None, nd: int = 2) -> str:
    return "?" if x is None else f"{x:.{nd}f}"


def report_faults(res: dict[str, Any]) -> None:
    f = res["faults"]
    print("faults:")
    for e in f["events"]:
        extra = ", ".join(f"{k} {v}" for k, v in e.items() if k not in ("t", "event"))
        print(f"  t={e['t']:7.2f} s  {e['event']}" + (f" ({extra})" if extra else ""))
    k = f["engine_kill"]
    if k is not None:
        print(f"engine kill: engine {k['engine']} at {k['at_s']:.1f} s held "
              f"{k['programs_on_it']} programs; marked unhealthy after "
              f"{_s(k['marked_unhealthy_after_s'])} s; started again after {k['down_s']:g} s, "
              f"healthy again {_s(k['healthy_again_after_restart_s'])} s after it answered "
              f"({_s(k['healthy_again_after_kill_s'])} s after the kill); "
              f"mori_failover_programs_total {k['failover_programs_total']}")
        print(f"  its programs' first 200 after the kill: {k['programs_with_a_200_after']} "
              f"programs, first {_s(k['first_200_after_s'])} s, median "
              f"{_s(k['p50_first_200_after_s'])} s, last {_s(k['max_first_200_after_s'])} s")
    r = f["gateway_restart"]
    if r is not None:
        print(f"gateway restart at {r['at_s']:.1f} s: stopped after {r['stopped_after_s']:.2f} s "
              f"(rc {r['stop_rc']}), answering again after {r['up_after_s']:.2f} s; "
              f"programs listed {r['programs_before']} before, {r['programs_after']} after "
              f"(engines hold KV of {r['engine_programs']})")
        print(f"  placement: kept {r['kept']}, moved to a replica holding their KV "
              f"{r['moved_to_replica_with_kv']}, LOST {r['lost']}; not judged: KV on no "
              f"engine {r['kv_on_no_engine']}, no replica before {r['no_replica_before']}, released "
              f"before {r.get('released_before', 0)}; "
              f"listed after but not before {r['restored_not_listed_before']} (of them released "
              f"by this client before the restart: {r['restored_released_by_client']})")
        for x in r["lost_samples"][:5]:
            print(f"  lost: {x}")
    for ln in f["restore_log"][:4]:
        print(f"  serve log: {ln}")
    for e in f["fault_task_errors"]:
        print(f"  FAULT TASK FAILED: {e}")


def report(res: dict[str, Any], table_rows: int) -> None:
    lat, p = res["latency_s"], res["programs"]
    print(f"wall {res['wall_s']:.1f} s (+{res['drain_s']:.1f} s draining in-flight requests)")
    print(f"requests: sent {res['sent']} (attempts, retries included), "
          f"completed {res['completed']} "
          f"({res['completed_per_s']:.1f}/s), errors {res['errors_total']} "
          f"{res['errors'] or ''}, retries {sum(res['retries'].values())} "
          f"{res['retries'] or ''}, retries cut by the end {res['gave_up_at_end']}")
    print(f"non-200 answers: clean {res['clean_total']} {res['clean'] or ''}, "
          f"UNCLEAN {res['unclean_total']} {res['unclean'] or ''}; retried while the "
          f"gateway restarted {sum(res['restart_retries'].values())} "
          f"{res['restart_retries'] or ''}")
    for e in res["unclean_samples"][:10]:
        print(f"  unclean sample: {e}")
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
    restarted = "faults" in res and res["faults"]["gateway_restart"] is not None
    print(f"RSS: last third's mean vs middle third's: {res['rss_growth_pct']:+.1f}% "
          f"({verdict}" + ("; the samples span the gateway's restart, two processes)"
                           if restarted else ")"))
    g = res["gateway_metrics"]
    print(f"gateway metrics: requests {g['mori_requests_total']}, held "
          f"{g['mori_held_requests_total']}, upstream errors "
          f"{g['mori_upstream_errors_total'] or 0}, client disconnects "
          f"{g['mori_client_disconnects_total']}")
    print(f"serve log ({res['serve_log']}): {res['serve_warning_count']} warning/error "
          f"lines; serve alive at end: {res['serve_alive']}")
    for ln in res["serve_warnings"][:10]:
        print(f"  {ln}")
    if "faults" in res:
        report_faults(res)
