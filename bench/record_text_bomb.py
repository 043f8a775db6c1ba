"""A ``--record-text`` bomb: ``mori serve --record FILE --record-text`` while 12 programs
each send ~25 MiB of prompt text, a concurrent client polling ``/healthz``.

    python bench/record_text_bomb.py [--programs 12] [--mib 25] [--step-kb 400]
        [--src SRC] [--serve-arg=--record-text-max-bytes=1048576] [--restart-file F]

Measured: the gateway's resident set (peak, against its RSS before the load: the growth is
what the recorded text costs), the longest ``/healthz`` answer while the programs send and
while they are released together (each release writes its program's line: before, a gzip
of its whole text on the event loop), and the time to start again with the record file
the run left (against starting with a new file, measured in the same run: the ratio is
what reading the file costs). ``--src``: the source tree to run (e.g. an older checkout
via ``git worktree add``, for a before/after); ``--restart-file``: also time a start with
that existing record file (e.g. the large one an older version left). The text is random
hex (compresses about 2:1), sent in ``--step-kb`` pieces (one step each: the simulated
engine's context window bounds one prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench.` when run as a script

from bench.benchutil import rss_mb  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def start(src: Path, record: Path, extra: list[str]) -> tuple[subprocess.Popen[str], str, float]:
    """``mori serve`` from ``src``; the process, its URL and the seconds it took to
    listen."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--port", "0",
                             "--log-level", "warning", "--time-scale", "50",
                             "--record", str(record), "--record-text",
                             "--max-body-bytes", str(8 * 1024 * 1024), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "listening on" in line:
            took = time.monotonic() - t0
            url = line.split("listening on ")[1].split()[0]
            threading.Thread(target=lambda: [None for _ in proc.stdout or ()],
                             daemon=True).start()
            return proc, url, took
    raise RuntimeError("mori serve exited before listening")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Poller:
    """Polls ``/healthz`` every 10 ms; the longest answer per phase."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.phase = "idle"
        self.worst: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self._stop.is_set():
                phase = self.phase
                t0 = time.monotonic()
                c.get(self.url + "/healthz")
                took = time.monotonic() - t0
                self.worst[phase] = max(self.worst.get(phase, 0.0), took)
                time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class RssSampler:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_mb(pid) or 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid) or 0.0)
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def program(url: str, model: str, pid: str, total: int, step: int) -> int:
    sent = 0
    with httpx.Client(base_url=url, timeout=300) as c:
        while sent < total:
            text = os.urandom(step // 2).hex()
            r = c.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 2, "program_id": pid,
                "messages": [{"role": "user", "content": text}]})
            r.raise_for_status()
            sent += len(text)
    return sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=12)
    ap.add_argument("--mib", type=float, default=25.0, help="text per program (MiB)")
    ap.add_argument("--step-kb", type=int, default=400, help="text per step (kB)")
    ap.add_argument("--src", type=Path, default=ROOT / "src")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="an extra mori serve argument (repeatable)")
    ap.add_argument("--restart-file", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = ap.parse_args()
    extra = [x for arg in a.serve_arg for x in arg.split("=", 1)]
    tmp = Path(tempfile.mkdtemp(prefix="record-bomb-"))
    record = tmp / "rec.jsonl.gz"
    out: dict[str, object] = {"src": str(a.src), "serve_args": extra,
                              "programs": a.programs, "mib_per_program": a.mib}
    try:
        proc, url, _ = start(a.src, record, extra)
        try:
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            time.sleep(0.5)
            base = rss_mb(proc.pid) or 0.0
            rss = RssSampler(proc.pid)
            poll = Poller(url)
            poll.phase = "send"
            t0 = time.monotonic()
            total, step = int(a.mib * 1024 * 1024), a.step_kb * 1000
            with ThreadPoolExecutor(a.programs) as ex:
                sent = sum(ex.map(lambda i: program(url, model, f"bomb-{i}", total, step),
                                  range(a.programs)))
            out["send_s"] = round(time.monotonic() - t0, 2)
            out["text_sent_mib"] = round(sent / 2**20, 1)
            poll.phase = "release"
            t1 = time.monotonic()
            with ThreadPoolExecutor(a.programs) as ex:
                list(ex.map(lambda i: httpx.post(f"{url}/v1/programs/bomb-{i}/release",
                                                 json={}, timeout=300), range(a.programs)))
            time.sleep(1.0)  # the lines written meanwhile (a writer thread, after the fix)
            out["release_s"] = round(time.monotonic() - t1, 2)
            poll.close()
            rss.close()
            out["rss_before_mb"] = round(base, 1)
            out["rss_peak_mb"] = round(rss.peak, 1)
            out["rss_growth_mb"] = round(rss.peak - base, 1)
            out["healthz_worst_ms"] = {k: round(v * 1000, 1) for k, v in poll.worst.items()}
        finally:
            stop(proc)
        out["record_file_mb"] = round(record.stat().st_size / 2**20, 1)
        fresh = tmp / "fresh.jsonl.gz"
        proc, _, took_new = start(a.src, fresh, extra)
        stop(proc)
        proc, _, took = start(a.src, record, extra)
        stop(proc)
        out["start_new_file_s"] = round(took_new, 2)
        out["start_with_record_s"] = round(took, 2)
        out["start_ratio"] = round(took / took_new, 2)
        if a.restart_file is not None:
            copy = tmp / ("given" + "".join(a.restart_file.suffixes[-2:]))
            shutil.copyfile(a.restart_file, copy)
            proc, _, took_given = start(a.src, copy, extra)
            stop(proc)
            out["restart_file_mb"] = round(copy.stat().st_size / 2**20, 1)
            out["start_with_given_file_s"] = round(took_given, 2)
            out["start_given_ratio"] = round(took_given / took_new, 2)
        if a.json is not None:
            shutil.copyfile(record, a.json.with_suffix(".jsonl.gz"))
            a.json.write_text(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
