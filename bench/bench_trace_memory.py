"""Peak memory of `mori trace stats` and `mori simulate` on a trace file with block
hashes, against the same file without them.

    python bench/bench_trace_memory.py [--copies 8] [--block-size 64] [--keep DIR]

The files: the shipped trace set's programs, repeated ``--copies`` times under new names,
written as canonical trace files twice: once with a chained block hash per
``--block-size`` prompt tokens of every step (each step repeats the hashes of the prefix
it reuses from the previous step, then draws new ones, as kv-cache-tester traces do),
once without. Each command runs in its own process; its peak resident set size is the
``VmHWM`` its process reports at exit (``/proc/self/status``: the high-water mark of its
own address space; ``ru_maxrss`` would also count the parent's pages the child had
before ``exec``). Linux only. Also measured, in a child that reads
the hashed file with its hashes kept: as this version keeps them (``BlockHashes``, 8 bytes
a hash) and as plain tuples of Python ints (the earlier form, rebuilt from the same file).
Ratios are against the hash-free file, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mori.cli.table import format_table  # noqa: E402
from mori.traces import default_traces, write_traceset  # noqa: E402
from mori.traces.model import ProgramTrace, Step, TraceSet, block_hashes  # noqa: E402

# runs a module or code as __main__ and, at exit, writes its VmHWM (KiB) to stderr
WRAP = """
import atexit, runpy, sys
def _hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                sys.stderr.write("\\nVMHWM " + line.split()[1] + "\\n")
atexit.register(_hwm)
kind, what = sys.argv[1], sys.argv[2]
sys.argv = [what] + sys.argv[3:]
if kind == "-m":
    runpy.run_module(what, run_name="__main__", alter_sys=True)
else:
    exec(compile(what, "<bench>", "exec"), {"__name__": "__main__"})
"""

READ_KEPT = """
import sys
from mori.traces import read_traceset
ts = read_traceset(sys.argv[1], hashes=True)
if sys.argv[2] == "tuples":
    from dataclasses import replace
    def conv(p):
        return replace(p, steps=tuple(replace(s, block_hashes=None if s.block_hashes is None
                       else tuple(int(h) for h in s.block_hashes),
                       subagents=tuple(replace(sp, program=conv(sp.program))
                                       for sp in s.subagents)) for s in p.steps))
    ts = [conv(p) for p in ts.programs]
print(len(ts.programs) if hasattr(ts, "programs") else len(ts))
"""


def with_hashes(p: ProgramTrace, block: int, rng: random.Random, name: str) -> ProgramTrace:
    """``p`` renamed, each step carrying chained block hashes (subagents too)."""
    prev: list[int] = []
    steps: list[Step] = []
    for s in p.steps:
        keep = min(len(prev), s.reuse_tokens // block)
        n = -(-s.prompt_tokens // block)
        hashes = prev[:keep] + [rng.getrandbits(62) for _ in range(max(0, n - keep))]
        subs = tuple(replace(sp, program=with_hashes(sp.program, block, rng,
                                                      f"{name}/{sp.program.name}"))
                     for sp in s.subagents)
        steps.append(replace(s, block_hashes=block_hashes(hashes), subagents=subs))
        prev = hashes
    return replace(p, name=name, steps=tuple(steps), block_size=block)


def renamed(p: ProgramTrace, name: str) -> ProgramTrace:
    subs = [[replace(sp, program=renamed(sp.program, f"{name}/{sp.program.name}"))
             for sp in s.subagents] for s in p.steps]
    return replace(p, name=name, steps=tuple(replace(s, subagents=tuple(sub))
                                             for s, sub in zip(p.steps, subs, strict=True)))


def peak_rss_mib(argv: list[str]) -> float:
    """Run ``python -m MODULE ARGS`` or ``python -c CODE ARGS`` (``argv`` without the
    interpreter); its peak resident set size in MiB (it must exit 0)."""
    proc = subprocess.run([sys.executable, "-c", WRAP, *argv], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    marks = [line for line in proc.stderr.splitlines() if line.startswith("VMHWM ")]
    if proc.returncode != 0 or not marks:
        raise SystemExit(f"{' '.join(argv[:2])} ... failed:\n{proc.stderr[-2000:]}")
    return int(marks[-1].split()[1]) / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=8,
                    help="times the shipped set's programs are repeated (default 8)")
    ap.add_argument("--block-size", type=int, default=64,
                    help="prompt tokens per block hash (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", type=Path, default=None,
                    help="write the two trace files here and keep them")
    args = ap.parse_args(argv)
    if args.copies < 1 or args.block_size < 1:
        ap.error("--copies and --block-size must be >= 1")
    base = default_traces()
    rng = random.Random(args.seed)
    hashed = TraceSet(f"{base.name}-x{args.copies}-hashed", tuple(
        with_hashes(p, args.block_size, rng, f"{p.name}#{c}")
        for c in range(args.copies) for p in base.programs))
    plain = TraceSet(f"{base.name}-x{args.copies}", tuple(
        renamed(p, f"{p.name}#{c}") for c in range(args.copies) for p in base.programs))
    out = args.keep or Path(tempfile.mkdtemp(prefix="bench-trace-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    f_hashed, f_plain = out / "hashed.jsonl.gz", out / "plain.jsonl.gz"
    write_traceset(hashed, f_hashed)
    write_traceset(plain, f_plain)
    n_hashes = sum(len(s.block_hashes or ()) for p in hashed.programs
                   for q in p.all_programs() for s in q.steps)
    steps = sum(len(q.steps) for p in plain.programs for q in p.all_programs())
    print(f"{len(plain.programs)} programs, {steps:,} steps, {n_hashes:,} block hashes; "
          f"files: {f_hashed.stat().st_size / 2**20:.1f} MiB with hashes, "
          f"{f_plain.stat().st_size / 2**20:.1f} MiB without", file=sys.stderr)
    commands = {
        "mori trace stats": ["-m", "mori", "trace", "stats", "{}", "--json"],
        "mori simulate": ["-m", "mori", "simulate", "--traces", "{}", "--policy", "mori",
                          "--programs", "20", "--duration", "600", "--quiet"],
    }
    rows = []
    for what, template in commands.items():
        base_mib = peak_rss_mib([a.replace("{}", str(f_plain)) for a in template])
        with_mib = peak_rss_mib([a.replace("{}", str(f_hashed)) for a in template])
        rows.append([what, f"{base_mib:.0f}", f"{with_mib:.0f}", f"{with_mib / base_mib:.2f}"])
    base_mib = peak_rss_mib(["-c", READ_KEPT.replace("hashes=True", "hashes=False"),
                             str(f_plain), "kept"])
    for form in ("kept", "tuples"):
        mib = peak_rss_mib(["-c", READ_KEPT, str(f_hashed), form])
        label = ("read, hashes kept (BlockHashes)" if form == "kept"
                 else "read, hashes kept as tuples (earlier form)")
        rows.append([label, f"{base_mib:.0f}", f"{mib:.0f}", f"{mib / base_mib:.2f}"])
    print(format_table(("command", "peak MiB, no hashes", "peak MiB, hashes",
                        "ratio"), rows, [False, True, True, True]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
