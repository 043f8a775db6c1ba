"""Build MORI's shipped default trace set from the kv-cache-tester sample.

Converts every ``*.json`` trace of the source directory (default: the 31 development
traces in /work/shared/data/kv-cache-tester/traces) into the canonical gzip JSON Lines
file ``src/mori/data/default_traces.jsonl.gz``, set name ``kv-cache-tester-31``. Per-step
token counts, block-hash prefix reuse, gaps and call durations (``api_time``) are kept;
the hash lists are dropped.
Each program's ``source`` is recorded relative to the source directory's grandparent
(``kv-cache-tester/traces/trace_0001.json``), so no local path is shipped. The output is
deterministic: rerunning on the same input gives the same bytes.

Usage: PYTHONPATH=src python scripts/build_default_traces.py [--src DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SRC = Path("/work/shared/data/kv-cache-tester/traces")
DEFAULT_OUT = REPO / "src" / "mori" / "data" / "default_traces.jsonl.gz"
SET_NAME = "kv-cache-tester-31"
EXPECTED_FILES = 31


def main(argv: list[str] | None = None) -> int:
    """Convert, write, read back and compare; return the process exit status."""
    parser = argparse.ArgumentParser(description="Build src/mori/data/default_traces.jsonl.gz")
    parser.add_argument("--src", type=Path, default=DEFAULT_SRC, help="kv-cache-tester dir")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .jsonl.gz")
    parser.add_argument("--name", default=SET_NAME, help="trace set name")
    parser.add_argument("--expect", type=int, default=EXPECTED_FILES, help="files expected")
    args = parser.parse_args(argv)
    src: Path = args.src.resolve()
    out: Path = args.out.resolve()

    sys.path.insert(0, str(REPO / "src"))  # works without installing the package
    from mori.traces import TraceSet, load_kvcache_tester_dir, read_traceset, write_traceset

    os.chdir(src.parent.parent)  # sources become "<grandparent-relative>/<file>"
    loaded = load_kvcache_tester_dir(Path(src.parent.name) / src.name)
    if len(loaded) != args.expect:
        print(f"error: {src} holds {len(loaded)} traces, expected {args.expect}")
        return 1
    traceset = TraceSet(name=args.name, programs=loaded.programs)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_traceset(traceset, out)
    if read_traceset(out) != traceset:
        print(f"error: {out} does not read back equal to what was written")
        return 1
    steps = sum(len(p.steps) for p in traceset.programs)
    print(f"wrote {out}: {len(traceset)} programs, {steps} steps, {out.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
