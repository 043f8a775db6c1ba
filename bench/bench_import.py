"""Claude Code import speed and memory: does importing stream in bounded memory?

Builds a synthetic ~100 MB Claude Code project folder by replicating the real sample
transcripts of tests/data/claude-code (each copy a new session: new session id and
request ids, timestamps shifted by a day per copy, subagent folders copied along), then
imports a ~10 MB prefix of it (the baseline) and the whole of it, each in a fresh
Python process writing a gzipped canonical file, and reports wall time, throughput, peak
resident memory (the child's ``VmHWM``) and the peak of Python allocations
(``tracemalloc``, in a second child, since tracing slows the import). Bounded memory
means the 100 MB / 10 MB ratio of the peaks stays near 1.

    python bench/bench_import.py [--mb 100] [--baseline-mb 10] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import uuid
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import HWM_SOURCE, scratch_dir

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "claude-code"

CHILD = HWM_SOURCE + """
import json, sys, time, tracemalloc
from pathlib import Path
trace = sys.argv[3] == "1"
if trace:
    tracemalloc.start()
t0 = time.perf_counter()
from mori.traces.importers import IMPORTERS
from mori.traces.import_common import ImportOptions
from mori.traces.jsonl import TraceWriter
options = ImportOptions()
with TraceWriter(sys.argv[2], "bench") as writer:
    for program in IMPORTERS.get("claude-code").programs([Path(sys.argv[1])], options):
        writer.write(program)
wall = time.perf_counter() - t0
peak_py = tracemalloc.get_traced_memory()[1] if trace else 0
r = options.report
print(json.dumps({"wall": wall, "rss_kb": hwm(),
                  "py_peak": peak_py, "programs": r.programs, "steps": r.steps,
                  "lines": r.lines}))
"""


def _shift(stamp: str, days: int) -> str:
    t = datetime.fromisoformat(stamp) + timedelta(days=days)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _perturb(line: str, copy: int, session: str) -> str:
    obj = json.loads(line)
    if "timestamp" in obj and isinstance(obj["timestamp"], str):
        obj["timestamp"] = _shift(obj["timestamp"], copy)
    if "sessionId" in obj:
        obj["sessionId"] = session
    if "requestId" in obj:
        obj["requestId"] = f"{obj['requestId']}-{copy}"
    return json.dumps(obj, separators=(",", ":")) + "\n"


def _copy_session(src: Path, dest_dir: Path, copy: int) -> int:
    session = str(uuid.uuid5(uuid.NAMESPACE_URL, f"mori-bench/{copy}/{src.name}"))
    written = 0
    with open(src) as fin, open(dest_dir / f"{session}.jsonl", "w") as fout:
        for line in fin:
            written += fout.write(_perturb(line, copy, session))
    agents = src.parent / src.stem / "subagents"
    if agents.is_dir():
        target = dest_dir / session / "subagents"
        target.mkdir(parents=True)
        for agent in agents.glob("agent-*.jsonl"):
            with open(agent) as fin, open(target / agent.name, "w") as fout:
                for line in fin:
                    written += fout.write(_perturb(line, copy, session))
    return written


def build(folder: Path, megabytes: float) -> list[int]:
    """Fill ``folder`` with copies of the sample until ``megabytes``; return the sizes in
    bytes after each copy."""
    folder.mkdir(parents=True, exist_ok=True)
    sizes: list[int] = []
    total, copy = 0, 0
    sessions = sorted(SAMPLE.glob("*.jsonl"))
    while total < megabytes * 1e6:
        for src in sessions:
            total += _copy_session(src, folder, copy)
        sizes.append(total)
        copy += 1
    return sizes


def run(folder: Path, out: Path, trace: bool) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(out),
                           "1" if trace else "0"], check=True, capture_output=True, text=True)
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="size of the big folder")
    parser.add_argument("--baseline-mb", type=float, default=10.0, help="baseline size")
    parser.add_argument("--keep", type=Path, help="build the folders here and keep them")
    args = parser.parse_args(argv)
    with scratch_dir(args.keep, "mori-bench-import-") as root:
        small, big = root / "small", root / "big"
        small_sizes = build(small, args.baseline_mb)
        big_sizes = build(big, args.mb)
        rows = []
        for label, folder, size in (("baseline", small, small_sizes[-1]),
                                    ("big", big, big_sizes[-1])):
            plain = run(folder, root / f"{label}.jsonl.gz", trace=False)
            traced = run(folder, root / f"{label}-t.jsonl.gz", trace=True)
            rows.append((label, size, plain, traced))
            print(f"{label:8} {size / 1e6:7.1f} MB  {plain['lines']:>9,} lines  "
                  f"{plain['programs']:>5,} sessions  {plain['steps']:>7,} steps  "
                  f"{plain['wall']:6.2f} s  {size / 1e6 / plain['wall']:5.1f} MB/s  "
                  f"peak RSS {plain['rss_kb'] / 1024:6.1f} MiB  "
                  f"peak Python allocations {traced['py_peak'] / 2**20:6.2f} MiB")
        (_, s_size, s_plain, s_traced), (_, b_size, b_plain, b_traced) = rows
        print(f"input ratio {b_size / s_size:.1f}x: peak RSS ratio "
              f"{b_plain['rss_kb'] / s_plain['rss_kb']:.2f}, peak Python allocations ratio "
              f"{b_traced['py_peak'] / s_traced['py_peak']:.2f}, time ratio "
              f"{b_plain['wall'] / s_plain['wall']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
