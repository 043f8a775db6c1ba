"""Helpers the benchmark scripts share: free ports, the open-file limit, a process's RSS
and CPU time, its children, percentiles, the end of a log file, a scratch folder, a
``mori sweep``'s runs. (Scripts import it as ``bench.benchutil``: ``bench/`` is a
package, and a script run as ``python bench/X.py`` puts the repo root on ``sys.path``.)"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile(want: int = 65536) -> int:
    """Raise this process's open-file limit (the child inherits it); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def tail(path: str, n: int) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time a process has used so far (``/proc/PID/stat``), or
    None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces; the fields after it start at ")"
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``, in pid order."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            out.append(int(entry))
    return sorted(out)


@contextlib.contextmanager
def scratch_dir(keep: Path | None, prefix: str) -> Iterator[Path]:
    """``keep`` (created, and kept), or a new temporary folder removed on leaving."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


#: Python source defining ``hwm()``: the running process's peak resident memory in KiB
#: (``VmHWM``), for a child started with ``python -c``. ``ru_maxrss`` would not do: Linux
#: carries the parent's peak over the exec.
HWM_SOURCE = """
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
"""


def sweep_runs(folders: list[Path], script: str) -> Iterator[dict[str, Any]]:
    """Every run record of the ``sweep.json`` of ``mori sweep`` output folders (or of the
    files given), in order; exits naming ``script`` and the file if one is not a sweep's."""
    for folder in folders:
        path = folder / "sweep.json" if folder.is_dir() else folder
        try:
            runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"{script}: {path}: not a mori sweep's sweep.json ({e})")
        yield from runs
