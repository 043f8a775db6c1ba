"""TraceLab import at the public release's scale: time and peak memory.

Generates a TraceLab round trace shaped like the public release (``syfi_coding_trace``:
357,161 rows, 140,338 Claude rows in 2,676 sessions and 216,823 Codex rows in 1,589;
figures from TraceLab's README and site), rows grouped by session as TraceLab's
collector writes them, gzipped; and a baseline a tenth of its size. Each is imported by
``mori trace import tracelab`` code in a fresh Python process writing a gzipped canonical
file; the script reports wall time, rows per second and peak resident memory
(the child's ``VmHWM``). Bounded memory means the full / baseline ratio of the peaks
stays near 1 while the input grows tenfold. ``--order shuffled`` writes the rows in a
random order instead, where the importer must hold every open session (the worst case).

The rows are synthetic: their shape (session lengths, events and tools per row, sizes)
follows the schema, not TraceLab's measured distributions.

    python bench/bench_tracelab_import.py [--rows 357161] [--order grouped|shuffled]
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import HWM_SOURCE, scratch_dir

RELEASE = {"claude": (140_338, 2_676), "codex": (216_823, 1_589)}  # rows, sessions
T0 = datetime(2026, 1, 5, tzinfo=UTC).timestamp()

CHILD = HWM_SOURCE + """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
from mori.traces.importers import IMPORTERS
from mori.traces.import_common import ImportOptions
from mori.traces.jsonl import TraceWriter
options = ImportOptions()
with TraceWriter(sys.argv[2], "bench") as writer:
    for program in IMPORTERS.get("tracelab").programs([Path(sys.argv[1])], options):
        writer.write(program)
r = options.report
print(json.dumps({"wall": time.perf_counter() - t0,
                  "rss_kb": hwm(), "programs": r.programs, "steps": r.steps, "lines": r.lines}))
"""

FLOOR = HWM_SOURCE + """
import gzip, json, sys, time
t0 = time.perf_counter()
n = 0
with gzip.open(sys.argv[1], "rb") as f:
    for line in f:
        json.loads(line)
        n += 1
print(json.dumps({"wall": time.perf_counter() - t0, "lines": n, "rss_kb": hwm()}))
"""


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def _session_rows(rng: random.Random, provider: str, sid: str, n: int,
                  start: float) -> list[str]:
    rows: list[str] = []
    t = start
    prompt = rng.randint(8_000, 30_000)
    claude = provider == "claude"
    for index in range(n):
        human = index == 0 or rng.random() < 0.03
        events = [{"event_type": "user_message" if human else "tool_result",
                   "timestamp": _iso(t), "source": "user.message" if human else "tool_result",
                   "content_chars": 80}]
        t += rng.uniform(1.0, 12.0)
        events.append({"event_type": "reasoning", "timestamp": _iso(t), "source": "assistant"})
        tools = []
        for k in range(rng.choice((0, 1, 1, 1, 2))):
            t += 0.2
            call = f"call_{rng.getrandbits(64):016x}"
            events.append({"event_type": "tool_call", "timestamp": _iso(t),
                           "source": "assistant.content.tool_use", "tool_call_id": call,
                           "tool_name": "Bash", "tool_index": k})
            wall = int(rng.lognormvariate(0.0, 2.0) * 1000)
            tools.append({"tool_index": k, "tool_name": rng.choice(("Bash", "Read", "Edit")),
                          "tool_call_id": call, "emitted_at": _iso(t),
                          "result_at": _iso(t + wall / 1000), "input_chars": 150,
                          "result_chars": 900, "tool_wall_latency_ms": wall,
                          "tool_internal_latency_ms": None if claude else max(0, wall - 3),
                          "is_error": False})
        if not claude:
            events.append({"event_type": "usage_report", "timestamp": _iso(t + 0.01),
                           "source": "event_msg.token_count"})
        append = rng.randint(100, 3_000)
        row = {
            "provider": provider, "project": "project_0001", "session_id": sid,
            "round_index": index, "round_id": f"{sid}:{index}", "model": "m",
            "input_tokens_total": prompt + append, "prefix_tokens": prompt,
            "newly_append_tokens": append,
            "claude_uncached_input_tokens": 2 if claude else None,
            "claude_cache_creation_input_tokens": append - 2 if claude else None,
            "claude_cache_read_input_tokens": prompt if claude else None,
            "output_tokens": rng.randint(20, 800),
            "reasoning_output_tokens": None if claude else rng.randint(0, 100),
            "timing_events": events, "tools": tools,
            "current_input_event_count": 1, "first_input_event_type": events[0]["event_type"],
            "store": ".claude" if claude else ".codex",
            "trace_key": f"{provider}:{sid}:{index}",
        }
        rows.append(json.dumps(row, separators=(",", ":")) + "\n")
        prompt += append
        t += max((tl["tool_wall_latency_ms"] for tl in tools), default=0) / 1000 + 0.05
    return rows


def build(path: Path, rows: int, order: str, seed: int = 0) -> tuple[int, int]:
    """Write about ``rows`` rows in the release's provider mix; return (rows, sessions)."""
    rng = random.Random(seed)
    scale = rows / sum(n for n, _ in RELEASE.values())
    written = sessions = 0
    held: list[str] = []
    with gzip.open(path, "wt", compresslevel=6) as out:
        for provider, (n_rows, n_sessions) in RELEASE.items():
            count = max(1, round(n_sessions * scale))
            mean = n_rows / n_sessions
            for s in range(count):
                n = max(1, round(rng.expovariate(1 / mean)))
                lines = _session_rows(rng, provider, f"{provider}:{s:08x}-sess", n,
                                      T0 + s * 3600.0)
                written += len(lines)
                sessions += 1
                if order == "grouped":
                    out.writelines(lines)
                else:
                    held.extend(lines)
        if held:
            rng.shuffle(held)
            out.writelines(held)
    return written, sessions


def _child(code: str, *args: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", code, *args], check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=357_161,
                        help="rows of the full file (default: the public release's 357,161)")
    parser.add_argument("--baseline-fraction", type=float, default=0.1,
                        help="the baseline file's size as a share of --rows (default 0.1)")
    parser.add_argument("--order", choices=("grouped", "shuffled"), default="grouped",
                        help="rows grouped by session (as TraceLab writes them) or shuffled")
    parser.add_argument("--keep", type=Path, help="build the files here and keep them")
    args = parser.parse_args(argv)
    with scratch_dir(args.keep, "mori-bench-tracelab-") as root:
        results = []
        for label, rows in (("baseline", max(1, round(args.rows * args.baseline_fraction))),
                            ("full", args.rows)):
            src = root / f"{label}.jsonl.gz"
            written, sessions = build(src, rows, args.order)
            floor = _child(FLOOR, str(src))
            got = _child(CHILD, str(src), str(root / f"{label}.mori.jsonl.gz"))
            results.append((label, written, got, floor))
            print(f"{label:8} {args.order:8} {written:>9,} rows {sessions:>6,} sessions "
                  f"{src.stat().st_size / 1e6:7.1f} MB gz  import {got['wall']:7.1f} s "
                  f"({written / got['wall']:8,.0f} rows/s, {got['wall'] / floor['wall']:4.1f}x "
                  f"the time to gunzip and parse the rows)  peak RSS "
                  f"{got['rss_kb'] / 1024:7.1f} MiB (parsing alone "
                  f"{floor['rss_kb'] / 1024:6.1f} MiB)  {got['programs']:,} programs "
                  f"{got['steps']:,} steps", flush=True)
        (_, b_rows, b, _), (_, f_rows, f, _) = results
        print(f"rows ratio {f_rows / b_rows:.1f}x: peak RSS ratio "
              f"{f['rss_kb'] / b['rss_kb']:.2f}, time ratio {f['wall'] / b['wall']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
