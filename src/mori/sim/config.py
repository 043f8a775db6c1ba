"""The typed configuration of one simulation run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mori.core.calibration import EngineCalibration
from mori.core.costmodel import PRESETS
from mori.core.hardware import DISKS
from mori.core.policies import POLICIES
from mori.core.policy import PolicyConfig
from mori.sim.workload import workload_problems


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One run. ``programs``: the concurrent programs (closed-loop slots) in all, over
    all ``replicas``; the command line's ``--programs`` counts them per replica
    (:attr:`programs_per_replica`): ``mori simulate --replicas 3 --programs 20`` runs
    ``programs=60``.

    ``cpu_ratio`` R: the CPU tier holds R x the GPU KV capacity of KV that is *not* on
    the GPU (with write-through the engine's host pool is (1 + R) x the device pool,
    since it also mirrors what is on the GPU). ``max_context`` None means the
    model's context window. ``stagger_s``: programs start uniformly spread over this
    many seconds (seeded) rather than all at t = 0.

    ``policy`` names the policy; ``policy_config`` holds its knobs (tick, idleness window,
    ...), validated by :class:`~mori.core.policy.PolicyConfig` itself. Its
    ``page_tokens`` is not used: the simulator accounts KV in the preset's pages.

    Modelling a given engine (e.g. a benchmark's small real one):

    - ``gpu_kv_tokens``: the GPU KV pool of a replica in tokens instead of the preset's,
      rounded down to whole pages of the preset (at least one page).
    - ``cpu_kv_tokens``: the CPU tier in tokens, in whole pages, as the policy sees it
      (the capacity for KV that is *not* on the GPU); given, it replaces ``cpu_ratio``.
      0: no CPU tier. Policies whose engine has no CPU tier ignore both.
    - ``token_scale``: every token count of the trace (prompt, reusable prefix, output)
      is multiplied by it, rounded, at least 1 (as ``mori replay --token-scale`` sends
      them). ``max_context`` stays in trace tokens (None: the context window divided by
      ``token_scale``, as the replay cuts at ``max_model_len / token_scale``).
    - ``engine_slowdown``: every engine duration (iterations, KV reloads) is multiplied by it:
      the engine runs that many times slower relative to the trace's gaps, which is what
      replaying a trace with ``mori replay --time-scale`` T against a real engine amounts
      to.
    - ``reload_gbps``: the host-to-GPU bandwidth of KV reloads, GB/s per GPU, instead of
      the preset's (None: the preset's; 0: no usable link, so no CPU tier is simulated,
      as at CPU ratio 0).
    - ``calibration``: engine constants measured on the machine being modelled
      (:class:`~mori.core.calibration.EngineCalibration`), applied to the preset (None:
      the preset's own).
    - ``plugin``: the engine runs MORI's plug-in where the policy's engine profile has
      one (typed eviction and admission, the policy's view of the host and disk tiers).
      False: MORI's decisions in front of an engine without it (``mori serve`` on plain
      vLLM): the engine keeps its host tier of ``cpu_kv_tokens`` (write-through, LRU)
      unseen by the policy, admits first come first served and is told nothing of a
      demotion.
    - ``learn_costs``: where the preset's reloads take the engine's time
      (``reload_on_engine``, the CPU build), the policy prices a park by that time, as
      ``mori serve --learn-costs`` learns it from such an engine (False: as
      ``--no-learn-costs``, a park costs the engine nothing). No effect elsewhere.
    - ``engine_queues``: the policy is told, at each decision, how many requests each
      replica's engine has waiting (queued for admission or loading KV), as ``mori
      serve`` reads its engines' waiting counts (``Policy.set_engine_queues``; the
      gateway samples them every ``--load-interval``, the simulator reads them exactly).
      False (the default, and every sweep): no reading, so a replica's queue share stays
      0 and the policy prices its moves as before the gateway read them.
    - ``front_s``: the fronts' time per request, in seconds of the engine's clock (scaled
      by ``engine_slowdown`` as engine durations are): what a request spends outside the
      engine and the gateway's hold, from the client's send to the gateway's decision on
      it (the client's and the gateway's hops, the gateway's ``/tokenize`` call).
      Modelled as that delay before the policy sees the request; the time is in its TTFT.
      0 (the default): none. ``bench/sim_fidelity.py --fronts`` sets it from what the
      bench measured (``latency_split``): measured, not predicted.
    - ``max_output_tokens``: every step's output is cut at this many tokens (after
      ``token_scale``), as by a model that ends its answers early: the benchmark's
      random-weight model stops at its end-of-sequence token after 1-2 tokens whatever
      ``max_tokens`` asks (None: the trace's lengths).

    The disk tier (a third pool per replica, under the CPU tier; ``mori.sim.kvcache``):

    - ``disk_ratio`` R: each replica's disk tier holds R x its GPU KV pool (0: none);
      ``disk_kv_tokens``, given, replaces it (in tokens, whole pages). Only where the
      policy's engine has a CPU tier (the disk sits under it) and a link to reload over.
    - ``disk``: the drive(s) simulated, a name of ``mori.core.hardware.DISKS`` (their
      bandwidths and latency; the tier may not exceed their capacity).
    """

    policy: str = "mori"
    programs: int = 50
    hardware: str = "h200-qwen3-30b-a3b"
    cpu_ratio: float = 1.0
    replicas: int = 1
    duration_s: float = 3600.0
    seed: int = 0
    human_gap: str = "cap"
    human_gap_cap_s: float = 60.0
    max_context: int | None = None
    share_prefix: bool = False
    stagger_s: float = 30.0
    gpu_kv_tokens: int | None = None
    cpu_kv_tokens: int | None = None
    token_scale: float = 1.0
    engine_slowdown: float = 1.0
    reload_gbps: float | None = None
    max_output_tokens: int | None = None
    disk_ratio: float = 0.0
    disk_kv_tokens: int | None = None
    disk: str = "nvme-gen5"
    policy_config: PolicyConfig = PolicyConfig()
    calibration: EngineCalibration | None = None
    plugin: bool = True
    learn_costs: bool = True
    engine_queues: bool = False
    front_s: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"unknown policy {self.policy!r}; valid: {', '.join(POLICIES.names())}")
        if self.hardware not in PRESETS:
            problems.append(f"unknown hardware preset {self.hardware!r}; "
                            f"valid: {', '.join(PRESETS.names())}")
        if not isinstance(self.policy_config, PolicyConfig):  # its own fields checked it
            problems.append(f"policy_config must be a PolicyConfig (got {self.policy_config!r})")
        for name in ("cpu_ratio", "disk_ratio", "duration_s", "human_gap_cap_s", "stagger_s", "token_scale",
                     "engine_slowdown"):
            if not math.isfinite(getattr(self, name)):
                problems.append(f"{name} must be a finite number (got {getattr(self, name)})")
        for name in ("token_scale", "engine_slowdown"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.reload_gbps is not None and not (math.isfinite(self.reload_gbps)
                                               and self.reload_gbps >= 0):
            problems.append(f"reload_gbps must be a finite number >= 0 (got {self.reload_gbps})")
        problems += self._kv_problems()
        if not (math.isfinite(self.front_s) and self.front_s >= 0):
            problems.append(f"front_s must be a finite number of seconds >= 0 "
                            f"(got {self.front_s})")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            problems.append(f"max_output_tokens must be >= 1 (got {self.max_output_tokens})")
        if self.replicas < 1:
            problems.append(f"replicas must be >= 1 (got {self.replicas})")
        if self.cpu_ratio < 0:
            problems.append(f"cpu ratio must be >= 0 (got {self.cpu_ratio})")
        problems += workload_problems(self.programs, self.duration_s, self.stagger_s,
                                      self.human_gap, self.human_gap_cap_s, self.max_context)
        if problems:
            raise ValueError("invalid simulation settings: " + "; ".join(problems))

    @property
    def programs_per_replica(self) -> float:
        """``programs`` / ``replicas``: what ``--programs`` gives. An ``int`` when
        ``programs`` is a multiple of ``replicas`` (as the command line makes it)."""
        whole, rest = divmod(self.programs, self.replicas)
        return whole if rest == 0 else self.programs / self.replicas

    def _kv_problems(self) -> list[str]:
        """What is wrong with the KV pool overrides (empty when nothing is)."""
        problems = []
        if self.gpu_kv_tokens is not None:
            page = PRESETS.get(self.hardware).page_tokens if self.hardware in PRESETS else 1
            if self.gpu_kv_tokens < page:
                problems.append(f"gpu_kv_tokens must hold at least one page of {page} tokens "
                                f"(got {self.gpu_kv_tokens})")
        if self.cpu_kv_tokens is not None and self.cpu_kv_tokens < 0:
            problems.append(f"cpu_kv_tokens must be >= 0 (got {self.cpu_kv_tokens})")
        if self.disk_ratio < 0:
            problems.append(f"disk ratio must be >= 0 (got {self.disk_ratio})")
        if self.disk_kv_tokens is not None and self.disk_kv_tokens < 0:
            problems.append(f"disk_kv_tokens must be >= 0 (got {self.disk_kv_tokens})")
        if self.disk not in DISKS:
            problems.append(f"unknown disk {self.disk!r}; valid: {', '.join(DISKS.names())}")
        return problems
