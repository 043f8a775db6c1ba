"""MORI's disk tier on the real engine: vLLM's tiering spec with ``MoriDiskTier`` behind the
host tier, chunk files evicted in MORI's order.

Two fresh engines with the same GPU pool (40 blocks of 32 tokens), the same host tier (32
chunks of one block) and the same disk tier (48 chunk files, in a temporary directory): one with MORI's plug-in (its scheduler binds the disk tier to the labels), one
without (the same tier, unbound: least recently used first).

1. A, B and C each send a prompt of about 12 blocks. Every full block is written through
   to the host tier, and from it to the disk tier (33 files; the host tier keeps 32).
2. On the plug-in engine the label channel labels A ``cold`` (MORI parked it on disk),
   B ``busy`` and C ``inactive``.
3. D sends a prompt of about 28 blocks. The GPU (4 blocks free) gives up C's blocks, then
   A's (MORI's GPU order, ``mori.core.eviction_order``: inactive, cold, idle, busy; LRU:
   A, the oldest, first), the host tier gives up most of A's, B's and C's chunks for D's
   (inactive C and cold A first), and the disk tier (48) must give up about 12 files for
   D's (MORI's order: inactive C, then busy B, keeping cold A; LRU: the oldest, A,
   first).
4. The plug-in's ``residency`` names each program's chunks on disk; then A and C are asked
   again.

With the plug-in, A's return is read from the disk tier (cached tokens, tiering read
bytes and the tier's files) and C's files are gone first. Without it, A's files went
first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import BLOCK_SIZE, ENGINE_RELEASES, stop_group
from .plugin_engine import Engine, ask, ask_plugin, fit_prompt, label, metric, post, start_engine

pytestmark = pytest.mark.e2e

NUM_BLOCKS = 40  # A, B and C fill 36: D's 28 take C's and A's GPU blocks, B's stay
CPU_CHUNKS = 32
DISK_CHUNKS = 48
CHUNK_BYTES = 2 * 2 * 1 * 64 * 2 * BLOCK_SIZE  # layers x (K, V) x KV heads x head dim x bf16
FILE_BYTES = CHUNK_BYTES + 56  # + mori.vllm_plugin.disk_tier.HEADER.size (the handshake
# test fails if it changes: the tier's size in chunks would)
CPU_GIB = CPU_CHUNKS * CHUNK_BYTES / (1 << 30)
DISK_GIB = DISK_CHUNKS * FILE_BYTES / (1 << 30)
PROGRAM_BLOCKS = 12
PRESSURE_BLOCKS = 28
READ = "vllm:kv_offload_tiering_read_bytes_total"
WRITTEN = "vllm:kv_offload_tiering_write_bytes_total"


@dataclass(frozen=True)
class Outcome:
    prompt_tokens: dict[str, int]
    cached: dict[str, int]  # when asked again after D
    disk_before: dict[str, int]  # tokens on disk per program after D (plug-in only)
    read_bytes: float  # bytes read from the disk tier for A's return
    written_bytes: float  # bytes written to it in the whole run
    files: int  # chunk files in the tier's directory after D
    shm_left: bool  # the host tier's /dev/shm file still has a name while the engine runs
    handshake: dict[str, Any] | None


def _files(root: Path) -> int:
    return sum(1 for p in root.glob("mori-kv-*/*.kv"))


def _scenario(engine: Engine, root: Path) -> Outcome:
    url = engine.url
    prompts = {p: fit_prompt(url, seed, PROGRAM_BLOCKS) for seed, p in enumerate("ABC")}
    pressure = fit_prompt(url, 99, PRESSURE_BLOCKS)
    sizes = {p: post(url + "/tokenize", {"model": "tiny", "prompt": t})["count"]
             for p, t in prompts.items()}
    for p in "ABC":
        ask(url, f"prog-{p}", prompts[p])
    handshake = None
    if engine.labels is not None:
        replies = label(engine.labels, {"prog-A": "cold", "prog-B": "busy",
                                        "prog-C": "inactive"})
        handshake = replies["hello"]
        assert replies["set"]["ok"], replies
        time.sleep(0.5)  # applied at the scheduler's next step
    ask(url, "prog-D", pressure)
    time.sleep(1.0)  # the tier's writes run on its own thread
    disk: dict[str, int] = {}
    if engine.labels is not None:
        res = ask_plugin(engine.labels, [("residency", {})])["residency"]
        disk = dict(res.get("disk", {}))
    files = _files(root)
    engine_id = next(root.glob("mori-kv-*")).name.removeprefix("mori-kv-")
    shm_left = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()
    read0 = metric(url, READ)
    cached = {"A": ask(url, "prog-A", prompts["A"])}
    read1 = metric(url, READ)
    cached["C"] = ask(url, "prog-C", prompts["C"])
    return Outcome(sizes, cached, disk, read1 - read0, metric(url, WRITTEN), files, shm_left,
                   handshake)


@pytest.fixture(scope="module", params=ENGINE_RELEASES)
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[dict[str, Outcome]]:
    """The scenario on each supported vLLM release (the tiering spec's interface is the
    same in 0.32 and 0.33)."""
    import os
    release: str = request.param
    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    out: dict[str, Outcome] = {}
    tmp = tmp_path_factory.mktemp("disk-tier")
    root = tmp / "disk"  # both engines' tiers, one after the other
    root.mkdir()
    for plugin in (True, False):
        key = "plugin" if plugin else "plain"
        engine, proc = start_engine(tmp, plugin=plugin, num_blocks=NUM_BLOCKS,
                                    cpu_gib=CPU_GIB, disk=(DISK_GIB, root),
                                    name=f"disk-tier-{release}-{key}", release=release)
        try:
            # a killed engine leaves its files; the next tier to start removes them
            assert len(list(root.glob("mori-kv-*"))) == 1, list(root.iterdir())
            out[key] = _scenario(engine, root)
            log = engine.log.read_text(errors="replace")
            assert "Traceback" not in log, log[-3000:]
            assert "MORI disk tier:" in log, log[-3000:]
            assert f"LLM engine (v{release}" in log, log[-3000:]
        finally:
            stop_group(proc)
    print(f"disk tier, vLLM {release}:", {k: (v.cached, v.disk_before, v.read_bytes, v.files)
                         for k, v in out.items()}, file=sys.stderr)
    yield out


def test_the_handshake_reports_the_disk_tiers_size(outcomes: dict[str, Outcome]) -> None:
    hello = outcomes["plugin"].handshake
    assert hello is not None, outcomes
    assert hello["cpu_tier_tokens"] == CPU_CHUNKS * BLOCK_SIZE, hello
    assert hello["disk_tier_tokens"] == DISK_CHUNKS * BLOCK_SIZE, hello


def test_every_chunk_is_written_through_to_the_disk_and_the_disk_stays_full(
        outcomes: dict[str, Outcome]) -> None:
    for name, o in outcomes.items():
        # A, B, C and D: more chunks than the tier holds were written; it holds 48
        assert o.written_bytes >= (3 * (PROGRAM_BLOCKS - 1) + PRESSURE_BLOCKS - 1) * CHUNK_BYTES
        assert o.files == DISK_CHUNKS, (name, o)


def test_the_host_tiers_shared_memory_is_unlinked_once_mapped(
        outcomes: dict[str, Outcome]) -> None:
    # the kernel frees it when the engine exits, even when the engine is killed
    assert not any(o.shm_left for o in outcomes.values()), outcomes


def test_a_cold_programs_return_is_read_from_the_disk(outcomes: dict[str, Outcome]) -> None:
    o = outcomes["plugin"]
    assert o.disk_before.get("prog-A", 0) >= (PROGRAM_BLOCKS - 1) * BLOCK_SIZE, o
    assert o.cached["A"] >= o.prompt_tokens["A"] - BLOCK_SIZE, o
    assert o.read_bytes >= (PROGRAM_BLOCKS - 1) * CHUNK_BYTES, o


def test_the_inactive_programs_files_go_first(outcomes: dict[str, Outcome]) -> None:
    o = outcomes["plugin"]
    assert o.disk_before.get("prog-C", 0) == 0, o  # the newest of the three, inactive
    assert o.cached["C"] <= BLOCK_SIZE, o


def test_an_unbound_disk_tier_loses_the_oldest_whatever_its_label(
        outcomes: dict[str, Outcome]) -> None:
    plain, typed = outcomes["plain"], outcomes["plugin"]
    assert plain.cached["A"] <= BLOCK_SIZE, plain
    assert plain.read_bytes < CHUNK_BYTES * 2, plain
    assert typed.cached["A"] > plain.cached["A"], (typed, plain)


def test_the_disk_tier_benchmark_runs_through_mori_serve(tmp_path: Path) -> None:
    """``bench/bench_vllm_disk.py`` on a tiny setting: both arms run behind ``mori serve``;
    with the disk tier the gateway parks programs on disk and the engine reads them back."""
    import json
    import os
    import subprocess

    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_vllm_disk.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--programs", "6", "--duration", "600", "--blocks", "64",
         "--cpu-blocks", "96", "--disk-chunks", "512", "--rounds", "1", "--logs",
         str(tmp_path / "logs"), "--json", str(tmp_path / "rows.json")],
        capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "disk / two-tier steps per second" in out.stdout
    rows = {r["arm"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert rows["two-tier"]["disk_read_bytes"] == 0, rows
    assert rows["disk"]["demotions_to_disk"] > 0 and rows["disk"]["disk_read_bytes"] > 0, rows
    assert rows["disk"]["recomputed_share"] <= rows["two-tier"]["recomputed_share"], rows
