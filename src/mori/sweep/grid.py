"""Sweep definitions: grids of simulation runs, and the registry of named sweeps.

A sweep is a union of *blocks*; a block is the cartesian product hardware presets x CPU
ratios x disk ratios x replica counts x programs x policies, sharing the simulation
options of the sweep (duration, seed, human-gap rule, ...). A *setting* is one (preset,
CPU ratio, disk ratio, replicas); within it, runs go over programs x policies, policy
varying fastest. A block's disk ratios default to (0,): no disk tier.

``programs`` is per replica (the paper's convention at DP > 1): a run of a setting with
N replicas simulates ``programs x N`` programs in total.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mori.core.policies import PAPER_POLICIES
from mori.core.registry import Registry
from mori.sim.config import SimConfig


@dataclass(frozen=True, slots=True)
class Block:
    """One cartesian product of grid values."""

    hardware: tuple[str, ...]
    cpu_ratio: tuple[float, ...]
    replicas: tuple[int, ...]
    programs: tuple[int, ...]
    policy: tuple[str, ...]
    disk_ratio: tuple[float, ...] = (0.0,)

    def size(self) -> int:
        """The number of runs in the block."""
        return (len(self.hardware) * len(self.cpu_ratio) * len(self.disk_ratio)
                * len(self.replicas) * len(self.programs) * len(self.policy))


@dataclass(frozen=True, slots=True)
class SweepDef:
    """A sweep: its blocks, in order, and the simulation options every run shares.

    ``base`` holds the non-grid :class:`SimConfig` fields (duration, seed, human gap,
    ...); its grid fields are ignored. ``traces`` None means the shipped default set.
    """

    name: str | None
    description: str
    blocks: tuple[Block, ...]
    base: SimConfig = field(default_factory=SimConfig)
    traces: Path | None = None

    def size(self) -> int:
        """The number of runs in the sweep (its blocks must not overlap)."""
        return sum(b.size() for b in self.blocks)


@dataclass(frozen=True, slots=True)
class Setting:
    """One (preset, CPU ratio, replicas, disk ratio): one JSON file and one figure in the
    output."""

    hardware: str
    cpu_ratio: float
    replicas: int
    disk_ratio: float = 0.0

    @property
    def stem(self) -> str:
        """The output file name without its suffix: ``<preset>_cpu<R>_dp<N>``, with
        ``_disk<D>`` where there is a disk tier."""
        disk = f"_disk{self.disk_ratio:g}" if self.disk_ratio else ""
        return f"{self.hardware}_cpu{self.cpu_ratio:g}{disk}_dp{self.replicas}"


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a sweep: its setting, its per-replica programs and its full config."""

    setting: Setting
    programs_per_replica: int
    config: SimConfig


class DuplicateRunError(ValueError):
    """A sweep that lists the same run twice."""


def expand(sweep: SweepDef) -> list[Run]:
    """Every run of ``sweep`` in grid order: block by block, then preset, CPU ratio, disk
    ratio, replicas, programs, policy (fastest).

    Builds each run's :class:`SimConfig` (``programs`` = per-replica programs x
    replicas), so a bad value raises ``ValueError`` here;
    the same run listed twice raises :class:`DuplicateRunError`.
    """
    runs: list[Run] = []
    seen: set[SimConfig] = set()
    for b in sweep.blocks:
        for hw in b.hardware:
            for cpu in b.cpu_ratio:
                for disk in b.disk_ratio:
                    for dp in b.replicas:
                        setting = Setting(hw, cpu, dp, disk)
                        for n in b.programs:
                            if n < 1:
                                raise ValueError(
                                    f"programs must be >= 1 per replica (got {n})")
                            for pol in b.policy:
                                config = dataclasses.replace(
                                    sweep.base, policy=pol, hardware=hw, cpu_ratio=cpu,
                                    disk_ratio=disk, replicas=dp, programs=n * dp)
                                if config in seen:
                                    raise DuplicateRunError(
                                        f"the sweep lists a run twice: {pol} at {n} programs "
                                        f"per replica on {setting.stem}")
                                seen.add(config)
                                runs.append(Run(setting, n, config))
    return runs


def settings_of(runs: list[Run]) -> list[Setting]:
    """The distinct settings of ``runs``, in order of first appearance."""
    return list(dict.fromkeys(r.setting for r in runs))


PAPER_PRESETS = ("h200-80g-qwen2.5-7b", "h200-qwen3-30b-a3b", "b200-llama3.1-70b-tp2")
"""The three hardware presets of the paper's evaluation."""


NEVER_LOSES_POLICIES = ("thunderagent", "thunderagent+offload", "lru-offload", "mori",
                        "mori-paper")
"""The ``never-loses`` sweep's policies: the default MORI, the paper's, and the
baselines it must not lose to (``bench/never_loses.py`` reads the ratios)."""

DISK_POLICIES = ("mori", "lru-offload")
"""The ``disk`` sweep's policies: MORI's idleness order over three tiers, and the LRU
order peers keep over theirs (the engine's disk tier under ``lru-offload``'s host tier)."""

FLEET_REPLICAS = (13, 38, 125)
"""The ``fleet`` sweep's replica counts: 80 programs each makes about 1,000, 3,000 and
10,000 programs."""


def _build() -> Registry[SweepDef]:
    reg: Registry[SweepDef] = Registry("sweep")
    paper_progs, paper_cpu = (20, 50, 80), (1.0, 2.0)
    paper_pols = (*PAPER_POLICIES, "mori-paper")
    reg.register("paper", SweepDef(
        "paper",
        "the paper's grid: 3 presets x cpu 1,2 x 20/50/80 programs x the 4 paper policies "
        "(and the paper's MORI, mori-paper) at DP=1, plus h200-qwen3-30b-a3b at DP=3 "
        "(programs per replica); 1 h, seed 0",
        (Block(PAPER_PRESETS, paper_cpu, (1,), paper_progs, paper_pols),
         Block(("h200-qwen3-30b-a3b",), paper_cpu, (3,), paper_progs, paper_pols)),
        SimConfig(duration_s=3600.0, seed=0)))
    reg.register("never-loses", SweepDef(
        "never-loses",
        "MORI against the baselines everywhere: 3 presets x cpu 0,0.25,0.5,1,2 x DP 1,3 x "
        "5/10/20/50/80 programs per replica x TA, TA+offload, lru-offload, mori, "
        "mori-paper; 1 h, seed 0 (bench/never_loses.py draws the ratios)",
        (Block(PAPER_PRESETS, (0.0, 0.25, 0.5, 1.0, 2.0), (1, 3), (5, 10, 20, 50, 80),
               NEVER_LOSES_POLICIES),),
        SimConfig(duration_s=3600.0, seed=0)))
    reg.register("disk", SweepDef(
        "disk",
        "the disk tier: 30B and 70B presets x cpu 0.5,1,2 x disk 0,2,8,32 (x the GPU pool, "
        "one nvme-gen5 drive) x 50/80/160 programs x mori and lru-offload; DP=1, 1 h, "
        "seed 0 (bench/disk_tier.py draws the ratios to two-tier mori)",
        (Block(("h200-qwen3-30b-a3b", "b200-llama3.1-70b-tp2"), (0.5, 1.0, 2.0), (1,),
               (50, 80, 160), DISK_POLICIES, disk_ratio=(0.0, 2.0, 8.0, 32.0)),),
        SimConfig(duration_s=3600.0, seed=0)))
    reg.register("fleet", SweepDef(
        "fleet",
        "fleet scale: h200-qwen3-30b-a3b, cpu 2, 80 programs per replica on 13/38/125 "
        "replicas (1,040 / 3,040 / 10,000 programs) x the 4 paper policies; 1 h, seed 0",
        (Block(("h200-qwen3-30b-a3b",), (2.0,), FLEET_REPLICAS, (80,), PAPER_POLICIES),),
        SimConfig(duration_s=3600.0, seed=0)))
    reg.register("smoke", SweepDef(
        "smoke",
        "a tiny grid for tests: h200-qwen3-30b-a3b, cpu 1, 3 programs, mori and smg, 60 s",
        (Block(("h200-qwen3-30b-a3b",), (1.0,), (1,), (3,), ("mori", "smg")),),
        SimConfig(duration_s=60.0, seed=0)))
    reg.freeze()
    return reg


SWEEPS = _build()
"""The named sweeps (frozen): ``mori sweep NAME``; ``mori sweep --list`` shows them."""
