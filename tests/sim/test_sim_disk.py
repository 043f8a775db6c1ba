"""The simulator's disk tier: the cost model's disk reads and writes, the engine's disk
link, a run's disk metrics and settings, and the record that carries them."""

from __future__ import annotations

import dataclasses

import pytest

from mori.core.costmodel import CostModel, get_preset
from mori.core.hardware import DISKS, NVME_GEN5, NVME_GEN5_RAID0X4, DiskSpec
from mori.sim.clock import EventLoop
from mori.sim.config import SimConfig
from mori.sim.kvcache import KVPools
from mori.sim.replica_model import EngineReplica, SimRequest
from mori.sim.runner import SettingsError, Simulation, simulate
from mori.sweep.store import result_from_dict
from mori.traces import default_traces

B70 = "b200-llama3.1-70b-tp2"


def test_presets_are_the_cited_drives() -> None:
    assert DISKS.names() == ["nvme-gen5", "nvme-gen5-raid0x4"]
    assert (NVME_GEN5.read_bw, NVME_GEN5.write_bw, NVME_GEN5.latency_s) == (14e9, 10e9, 60e-6)
    assert NVME_GEN5_RAID0X4.read_bw == 4 * NVME_GEN5.read_bw
    assert NVME_GEN5_RAID0X4.latency_s == NVME_GEN5.latency_s
    with pytest.raises(ValueError, match="bandwidths"):
        DiskSpec("bad", 1, 0.0, 1.0, 0.0)


def test_a_disk_read_is_pipelined_through_pcie_and_pays_its_latency_once() -> None:
    cost = CostModel(get_preset(B70))
    kv = get_preset(B70).model.kv_bytes_per_token  # the replica's (both TP ranks')
    n = 100_000
    one = cost.disk_read_time(n, NVME_GEN5)
    assert one == pytest.approx(60e-6 + n * kv / 14e9)  # the drive is the slower
    raid = cost.disk_read_time(n, NVME_GEN5_RAID0X4)
    # 56 GB/s of drives against two 50 GB/s links each carrying half: the drives bind
    assert raid == pytest.approx(60e-6 + n * kv / 56e9)
    fast = DiskSpec("fast", 10**15, 1e12, 1e12, 0.0)
    assert cost.disk_read_time(n, fast) == pytest.approx(cost.reload_time(n))  # PCIe binds
    assert cost.disk_write_time(n, NVME_GEN5) == pytest.approx(n * kv / 10e9)
    assert cost.disk_read_time(0, NVME_GEN5) == 0.0
    slow = CostModel(get_preset(B70), engine_slowdown=3.0)
    assert slow.disk_read_time(n, NVME_GEN5) == pytest.approx(3 * one)


class _Recorder:
    def __init__(self) -> None:
        self.ready: list[tuple[str, float]] = []

    def kv_ready(self, req: SimRequest, now: float) -> None:
        self.ready.append((req.program_id, now))

    def first_token(self, req: SimRequest, now: float) -> None: ...
    def finished(self, req: SimRequest, now: float) -> None: ...
    def produced(self, tokens: int, now: float) -> None: ...


def test_a_request_whose_kv_is_on_disk_waits_for_the_read_and_counts_a_disk_hit() -> None:
    cost = CostModel(get_preset("h200-qwen3-30b-a3b"))
    page = cost.preset.page_tokens
    loop = EventLoop()
    rec = _Recorder()
    pools = KVPools(1_000, 0, True, disk_pages=1_000)
    eng = EngineReplica(0, cost, loop, pools, rec, True, disk=NVME_GEN5)
    e = pools.entry("a")
    pools.take_for_request(e, 100)
    eng.evict("a")  # no CPU pool: straight to disk, a write on the disk link
    assert (e.gpu, e.disk) == (0, 100) and eng.stats.disk_written_tokens == 100 * page
    write = cost.disk_write_time(100 * page, NVME_GEN5)
    eng.submit(SimRequest("a", prompt=100 * page + 10, reuse=100 * page, output=4,
                          arrived=0.0))
    loop.run(100.0)
    read = cost.disk_read_time(100 * page, NVME_GEN5)
    assert rec.ready == [("a", pytest.approx(write + read))]  # behind the write
    assert eng.stats.disk_hit_tokens == 100 * page and eng.stats.recomputed_tokens == 0


@pytest.fixture(scope="module")
def traces():  # type: ignore[no-untyped-def]
    return default_traces()


def test_a_run_with_a_disk_tier_reads_from_it_and_says_so(traces) -> None:  # type: ignore[no-untyped-def]
    base = SimConfig(policy="mori", programs=80, hardware=B70, cpu_ratio=1.0,
                     duration_s=900.0)
    two = simulate(base, traces)
    three = simulate(dataclasses.replace(base, disk_ratio=8.0), traces)
    assert two.disk_kv_capacity_tokens == 0 and two.disk_hit_rate == 0.0
    assert two.demotions_to_disk == 0 and two.disk_written_bytes == 0
    gpu_pages = three.gpu_kv_capacity_tokens // get_preset(B70).page_tokens
    assert three.disk_kv_capacity_tokens == 8 * gpu_pages * get_preset(B70).page_tokens
    assert three.demotions_to_disk > 0 and three.disk_hit_rate > 0
    assert three.disk_read_tokens > 0 and three.disk_written_bytes > 0
    assert three.recomputed_tokens < two.recomputed_tokens
    row = three.to_dict()
    assert (row["disk_ratio"], row["disk"]) == (8.0, "nvme-gen5")
    assert result_from_dict(row).to_dict() == row


def test_an_lru_engine_keeps_a_disk_tier_too_and_thunderagent_has_none(traces) -> None:  # type: ignore[no-untyped-def]
    cfg = SimConfig(policy="lru-offload", programs=40, hardware=B70, cpu_ratio=0.5,
                    disk_ratio=4.0, duration_s=600.0)
    r = simulate(cfg, traces)
    assert r.disk_kv_capacity_tokens > 0 and r.demotions_to_disk == 0  # the engine's LRU
    ta = Simulation(dataclasses.replace(cfg, policy="thunderagent"), traces)
    assert ta.disk_pages == 0  # its engine has no host tier to put a disk under


def test_a_record_written_before_the_disk_tier_still_loads(traces) -> None:  # type: ignore[no-untyped-def]
    row = simulate(SimConfig(programs=3, duration_s=60.0), traces).to_dict()
    for key in ("disk_ratio", "disk_kv_tokens", "disk", "disk_hit_rate", "disk_read_tokens",
                "disk_written_bytes", "demotions_to_disk", "disk_kv_capacity_tokens"):
        del row[key]
    assert result_from_dict(row).config.disk_ratio == 0.0


@pytest.mark.parametrize("bad", [dict(disk_ratio=-1.0), dict(disk_kv_tokens=-5),
                                 dict(disk="floppy")])
def test_bad_disk_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="invalid simulation settings: .*disk"):
        SimConfig(**bad)  # type: ignore[arg-type]


def test_a_disk_tier_larger_than_the_drive_is_refused(traces) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SettingsError, match="more than nvme-gen5 holds"):
        Simulation(SimConfig(hardware=B70, disk_ratio=100.0), traces)
    Simulation(SimConfig(hardware=B70, disk_ratio=100.0, disk="nvme-gen5-raid0x4"), traces)


def test_disk_kv_tokens_replace_the_ratio(traces) -> None:  # type: ignore[no-untyped-def]
    sim = Simulation(SimConfig(disk_ratio=8.0, disk_kv_tokens=64_000), traces)
    assert sim.disk_pages * get_preset("h200-qwen3-30b-a3b").page_tokens == 64_000


def test_decisions_to_and_from_disk_read_as_such() -> None:
    from mori.core.decisions import Demote, Promote
    from mori.core.explain import DecisionContext, reason
    from mori.core.types import Status, Tier

    ctx = DecisionContext(Status.ACTING, 0.9, 60_000, 0.0, 12.0, 1.5)
    why = reason(Demote("a", 0, Tier.GPU, Tier.DISK), ctx)
    assert "to the disk tier" in why and "a read from disk, about 1.50 s" in why
    assert "CPU tier needed room" in reason(Demote("a", 0, Tier.CPU, Tier.DISK), ctx)
    assert "DISK tier needed room" in reason(Demote("a", 0, Tier.DISK, Tier.NONE), ctx)
    assert "reads its KV back from the replica's disk tier" in reason(
        Promote("a", 0, Tier.DISK), ctx)


def test_a_timeline_of_a_run_with_a_disk_tier_draws_its_lane(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from mori.cli.main import main

    page = tmp_path / "t.html"
    assert main(["simulate", "--policy", "mori", "--programs", "80", "--preset", B70,
                 "--disk-ratio", "8", "--duration", "600", "--timeline", str(page),
                 "--timeline-frames", "20", "--quiet"]) == 0
    html = page.read_text()
    assert ">DISK\\u003c/text>" in html  # the spectrum's lane, in the page's JSON
    assert "disk tier" in html  # a decision's reason
