"""One agent client run through ``mori serve`` with a scripted simulated engine.

``run_through_gateway`` starts ``mori serve --engine-script`` (the script given as a
dict, any model name mapped onto the served one, ``--record`` with the prompt text),
runs the client's command against it to completion, reads ``/v1/programs``, stops the
gateway (which ends every open program, so the record is complete) and returns what the
tests assert on (``GatewayRun``). The scripts make the client run a real ``sleep 2``;
``SLEEP_S`` and ``TOOL_TOLERANCE`` say how close the tool time measured on the wire must
come to it.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from mori.core.costmodel import PRESETS
from mori.traces.jsonl import read_traceset
from mori.traces.model import ProgramTrace
from support.serve_process import stop, wait_listening

from .clis import run_cli

PRESET = "h200-qwen3-30b-a3b"
SERVED = PRESETS.get(PRESET).model.name
SLEEP_S = 2.0
TOOL_TOLERANCE = 0.2
"""The tool time measured on the wire (from the answer that called the tool to the
request that returns its result) must be within this fraction of ``SLEEP_S``."""

Command = Callable[[str], tuple[Sequence[str], Mapping[str, str]]]
"""The client's command line and environment, given the gateway's base URL."""


@dataclass
class GatewayRun:
    """What one client run left: its exit status and output, the wall time of the run,
    the named programs ``/v1/programs`` listed right after it, and the record."""

    returncode: int
    output: str
    wall_s: float
    programs: list[dict[str, Any]]
    record: Path

    def traces(self) -> list[ProgramTrace]:
        """Every recorded program, subagents (nested in their parent) included."""
        return [q for p in read_traceset(self.record).programs for q in p.all_programs()]

    def top_level(self) -> list[ProgramTrace]:
        return list(read_traceset(self.record).programs)

    def texts(self) -> list[str]:
        """The recorded prompt texts (each step's last turn), subagents' included."""
        out = []
        with gzip.open(self.record, "rt") as f:
            for line in f:
                stack = [json.loads(line)]
                while stack:
                    obj = stack.pop()
                    for s in obj.get("steps", ()):
                        if isinstance(s.get("text"), str):
                            out.append(s["text"])
                        stack.extend(sp["program"] for sp in s.get("subagents", ()))
        return out

    def tail(self, chars: int = 3000) -> str:
        return self.output[-chars:]


def near_sleep(seconds: float, client_s: float = 0.0) -> bool:
    """Whether a tool time is within ``TOOL_TOLERANCE`` of ``SLEEP_S`` (plus ``client_s``
    above it: what a client is known to add around each tool run)."""
    return -TOOL_TOLERANCE * SLEEP_S <= seconds - SLEEP_S <= TOOL_TOLERANCE * SLEEP_S + client_s


def measured(run: GatewayRun, name: str, gaps: Sequence[float]) -> None:
    """Say what was measured (``pytest -s`` shows it; docs/agents.md quotes it)."""
    print(f"\n[measured] {name}: wall {run.wall_s:.1f} s, tool time "
          + ", ".join(f"{g:.2f} s" for g in gaps))


def tool_gaps(program: ProgramTrace, tool: str) -> list[float]:
    """The gaps after the steps of ``program`` whose answer called ``tool``."""
    return [s.gap_s for s in program.steps if tool in s.tool_names]


def run_through_gateway(tmp: Path, script: Mapping[str, Any], command: Command,
                        workdir: Path, timeout_s: float = 50.0) -> GatewayRun:
    """Run the client ``command`` builds through ``mori serve`` answering from
    ``script`` (see the module doc)."""
    script_file = tmp / "script.json"
    script_file.write_text(json.dumps(script))
    record = tmp / "record.jsonl.gz"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mori", "serve", "--port", "0", "--preset", PRESET,
         "--engine-script", str(script_file), "--record", str(record), "--record-text",
         "--model-alias", f"*={SERVED}", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    try:
        url = wait_listening(proc)
        cmd, env = command(url)
        t0 = time.monotonic()
        try:
            done = run_cli(cmd, env, workdir, timeout_s=timeout_s)
            rc, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = -1, f"timed out after {timeout_s} s: {e.stdout!r} {e.stderr!r}"
        wall = time.monotonic() - t0
        rows = httpx.get(url + "/v1/programs").json()["data"]
    finally:
        stop(proc)  # ends every open program: the record is complete
    named = [r for r in rows if not r["anonymous"]]
    return GatewayRun(rc, output, wall, named, record)
