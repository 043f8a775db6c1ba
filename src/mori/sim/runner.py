"""One simulation run: a policy, engine replicas and the closed-loop workload.

The runner is the "world" of docs/architecture.md: it reports events to the policy, asks it
for decisions and executes them on the simulated engines. Closed loop: a program sends
its next request only after its previous response and its recorded gap; a finished
program's slot takes the next trace; a subagent is a program of its own, spawned at its
recorded delay, while its parent waits for it (its parent's residual gap follows).
These rules live in :mod:`mori.sim.plan`, shared with the live replay client.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mori.core.costmodel import CostModel, get_preset
from mori.core.decision_log import DecisionLog
from mori.core.engine_costs import EngineCosts
from mori.core.events import KVReady, ProgramEnded, RequestArrived, StepFinished
from mori.core.execution import DecisionExecutor
from mori.core.hardware import HardwarePreset, get_disk
from mori.core.ledger import ClusterSpec
from mori.core.policies import POLICIES, build_policy
from mori.core.policy import EngineProfile, Policy
from mori.core.types import Capability, KVLabel, Tier
from mori.sim.clock import PRIO_TICK, PRIO_WORKLOAD, EventLoop
from mori.sim.config import SimConfig
from mori.sim.kvcache import KVPools
from mori.sim.metrics import Counters, RunResult, percentile, ttft_stats
from mori.sim.plan import ProgramRun, ReplayPlan
from mori.sim.replica_model import EngineReplica, SimRequest
from mori.sim.workload import scale_program
from mori.traces.model import ProgramTrace, TraceSet
from mori.traces.stats import empty_set_note


class SettingsError(ValueError):
    """The settings cannot be simulated (said before any run starts)."""


@dataclass(slots=True, eq=False)
class _Live(ProgramRun):
    req: SimRequest | None = None
    children: list[_Live] = field(default_factory=list)


def kv_pages(config: SimConfig, cpu_tier: bool) -> tuple[int, int]:
    """The GPU and CPU pages of one replica: the preset's GPU pool, or
    ``config.gpu_kv_tokens``; the CPU tier (when the policy's engine has one) from
    ``config.cpu_kv_tokens``, else ``cpu_ratio`` x the GPU pool. Whole pages."""
    preset = get_preset(config.hardware)
    page = preset.page_tokens
    gpu_tokens = (config.gpu_kv_tokens if config.gpu_kv_tokens is not None
                  else preset.gpu_kv_capacity_tokens)
    gpu_pages = gpu_tokens // page
    if not cpu_tier or config.reload_gbps == 0:  # no link: nothing could be reloaded
        return gpu_pages, 0
    if config.cpu_kv_tokens is not None:
        return gpu_pages, config.cpu_kv_tokens // page
    return gpu_pages, int(gpu_pages * config.cpu_ratio)


def disk_pages(config: SimConfig, cpu_tier: bool, gpu_pages: int) -> int:
    """The disk pages of one replica: ``config.disk_kv_tokens``, else ``disk_ratio`` x
    the GPU pool; none where the policy's engine has no CPU tier (the disk tier sits
    under it) or no link to reload over. Raises ``SettingsError`` when the tier exceeds
    the drive's capacity."""
    preset = get_preset(config.hardware)
    page = preset.page_tokens
    if not cpu_tier or config.reload_gbps == 0:
        return 0
    pages = (config.disk_kv_tokens // page if config.disk_kv_tokens is not None
             else int(gpu_pages * config.disk_ratio))
    disk = get_disk(config.disk)
    need = pages * page * preset.kv_bytes_per_token_per_gpu * preset.tp
    if need > disk.capacity_bytes:
        raise SettingsError(
            f"a disk tier of {pages * page:,} tokens takes {need / 1e12:.2f} TB of KV on "
            f"{preset.name}, more than {disk.name} holds ({disk.capacity_bytes / 1e12:.1f} "
            "TB); lower --disk-ratio or pick a larger --disk")
    return pages


def engine_profile(config: SimConfig, profile: EngineProfile) -> EngineProfile:
    """The simulated engine under the policy: the policy's ``profile``, or, with
    ``config.plugin`` False, the same engine without MORI's plug-in: its tiers evicted
    LRU, requests admitted first come first served, told nothing of a demotion."""
    if config.plugin:
        return profile
    return EngineProfile(cpu_tier=profile.cpu_tier, typed_eviction=False,
                         drops_on_demote=False)


def sim_preset(config: SimConfig) -> HardwarePreset:
    """The preset simulated: ``config.hardware``, with ``config.calibration``'s engine
    constants and ``reload_gbps`` if given."""
    preset = get_preset(config.hardware)
    if config.calibration is not None:
        preset = config.calibration.applied_to(preset)
    if not config.reload_gbps:  # None: the preset's; 0: no CPU tier (kv_pages), no reload
        return preset
    return dataclasses.replace(preset, gpu=dataclasses.replace(
        preset.gpu, reload_bw=config.reload_gbps * 1e9))


def context_cut(config: SimConfig) -> int:
    """The context length programs are cut at, in trace tokens: ``max_context``, else the
    model's context window in trace tokens (divided by ``token_scale``, as the replay
    divides the engine's ``max_model_len``)."""
    if config.max_context is not None:
        return config.max_context
    window = get_preset(config.hardware).model.context_window
    return window if config.token_scale == 1.0 else max(1, int(window / config.token_scale))


SIM_ENGINE_CAPABILITIES = frozenset({Capability.LABELS, Capability.OFFLOAD, Capability.DROP})
"""The KV controls of a simulated engine replica (``EngineReplica``)."""


RECOMPUTE_RATE_CONTEXT = 32_768
"""The context whose prefill rate a policy prices a recompute at unless told one (the
model's window where that is shorter)."""


class Simulation:
    """Build with ``Simulation(config, traces)``, then ``run()`` once.

    ``log``: a decision log to keep every executed decision in (the parity test reads
    it); None keeps none.
    """

    def __init__(self, config: SimConfig, traces: TraceSet,
                 log: DecisionLog | None = None) -> None:
        self.config = config
        self.trace_name = traces.name
        preset = sim_preset(config)
        policy_cls = POLICIES.get(config.policy)
        self.cost = CostModel(preset, engine_slowdown=config.engine_slowdown)
        page = preset.page_tokens
        profile = engine_profile(config, policy_cls.engine_profile)
        self.gpu_pages, self.cpu_pages = kv_pages(config, profile.cpu_tier)
        self.disk_pages = disk_pages(config, profile.cpu_tier, self.gpu_pages)
        self.disk = get_disk(config.disk) if self.disk_pages else None
        max_ctx = context_cut(config)
        # the replay rules: prepared traces, seeded order and slot start times
        self.plan = ReplayPlan.build(traces.programs, slots=config.programs, seed=config.seed,
                                     stagger_s=config.stagger_s, max_context=max_ctx,
                                     human_gap=config.human_gap,
                                     human_gap_cap_s=config.human_gap_cap_s)
        # the engine's token counts (the plan's order indexes the same list)
        self.plan.programs = [scale_program(p, config.token_scale) for p in self.plan.programs]
        programs, self.left_out = self.plan.programs, self.plan.left_out
        if not traces.programs:
            raise SettingsError(empty_set_note(traces) or "")
        if not programs:
            raise SettingsError(
                f"no program of trace set {traces.name!r} fits a context of {max_ctx} trace "
                "tokens; raise --max-context or use other traces")
        cap_tokens = self.gpu_pages * page
        for p in programs:
            for q in p.all_programs():
                need = -(-q.peak_context_tokens // page) * page
                if need > cap_tokens:
                    raise SettingsError(
                        f"program {q.name!r} needs {need} tokens of KV at its peak but one "
                        f"replica's GPU tier holds {cap_tokens} tokens on {preset.name}; "
                        "lower --max-context to cut long programs, or pick a larger preset "
                        "(or --gpu-kv-tokens)")
        self.programs = programs
        kv_bytes = preset.kv_bytes_per_token_per_gpu * preset.tp
        self.kv_bytes = kv_bytes
        # without the plug-in the engine's host and disk tiers are its own: the policy
        # neither sees nor moves what they hold
        seen = 1 if config.plugin else 0
        cluster = ClusterSpec(config.replicas, self.gpu_pages * page * kv_bytes,
                              seen * self.cpu_pages * page * kv_bytes,
                              seen * self.disk_pages * page * kv_bytes)
        knobs = config.policy_config
        if knobs.reload_gbps is None:  # the link this run models, in policy time
            knobs = dataclasses.replace(
                knobs, reload_gbps=0.0 if config.reload_gbps == 0
                else preset.gpu.reload_bw / 1e9 / config.engine_slowdown)
        if self.disk is not None and knobs.disk_read_gbps is None:
            # the disk this run models, in policy time: its read, or the PCIe links
            # it is pipelined through where those are slower
            bw = min(self.disk.read_bw, preset.gpu.reload_bw * preset.tp)
            knobs = dataclasses.replace(
                knobs, disk_read_gbps=bw / 1e9 / config.engine_slowdown,
                disk_latency_s=self.disk.latency_s * config.engine_slowdown)
        if knobs.recompute_tok_s is None:  # this run's prefill rate (scaled durations)
            # of a context the model can hold (the default 32k is past the tiny CPU
            # model's window, where the rate would be a tenth of any real recompute's)
            knobs = dataclasses.replace(knobs, recompute_tok_s=self.cost.prefill_rate(
                min(RECOMPUTE_RATE_CONTEXT, preset.model.context_window)))
        self.policy: Policy = build_policy(config.policy, cluster, kv_bytes,
                                           dataclasses.replace(knobs, page_tokens=page))
        if preset.reload_on_engine and config.learn_costs:
            # what a gateway learns from such an engine (``mori serve --learn-costs``):
            # a reload costs the engine its copy time
            per_token = self.cost.reload_time(1_000_000) / 1_000_000
            for replica in range(config.replicas):
                self.policy.set_engine_costs(replica, EngineCosts(
                    reload_fixed_s=0.0, reload_per_token_s=per_token))
        self.loop = EventLoop()
        self._front_s = config.front_s * config.engine_slowdown  # the fronts' time, scaled
        typed = profile.typed_eviction
        self.engines = [
            EngineReplica(i, self.cost, self.loop,
                          KVPools(self.gpu_pages, self.cpu_pages, typed, self.disk_pages),
                          self, typed_admission=typed, disk=self.disk)
            for i in range(config.replicas)
        ]
        self.executor = DecisionExecutor(
            profile, lambda replica: SIM_ENGINE_CAPABILITIES, self, log)
        self.live: dict[str, _Live] = {}
        self.c = Counters()
        self._ran = False

    # -- the run ----------------------------------------------------------------------
    def run(self, observe: Callable[[Simulation], None] | None = None,
            every_s: float = 0.0) -> RunResult:
        """Run to the end. ``observe(self)``, if given, is called every ``every_s``
        simulated seconds and at the end, once every event up to that instant has run;
        it must only read (the run's results are the same with or without it)."""
        if self._ran:
            raise RuntimeError("a Simulation runs once; build a new one")
        self._ran = True
        cfg = self.config
        wall0 = time.perf_counter()
        for slot, start in enumerate(self.plan.start_times):
            self.loop.at(start, PRIO_WORKLOAD, self._start_slot, slot)
        tick = self.policy.tick_interval
        if tick:
            self.loop.at(tick, PRIO_TICK, self._tick, tick)
        if observe is not None and every_s > 0:
            k = 1
            while k * every_s < cfg.duration_s:
                self.loop.run(k * every_s)
                observe(self)
                k += 1
        self.loop.run(cfg.duration_s)
        if observe is not None:
            observe(self)
        return self._result(time.perf_counter() - wall0)

    def _tick(self, period: float) -> None:
        self._decide()
        self.loop.at(self.loop.now + period, PRIO_TICK, self._tick, period)

    def _start_slot(self, slot: int) -> None:
        self._start(self.plan.next_trace(), slot, None)

    def _start(self, trace: ProgramTrace, slot: int | None, parent: _Live | None) -> None:
        live = _Live(self.plan.instance_id(trace), trace, slot, parent)
        self.live[live.pid] = live
        self.c.programs_started += 1
        self._send(live)

    def _send(self, live: _Live) -> None:
        s = live.trace.steps[live.step]
        now = self.loop.now
        shared = (min(live.trace.shared_prefix_tokens, s.prompt_tokens)
                  if self.config.share_prefix else 0)
        cap = self.config.max_output_tokens
        output = s.output_tokens if cap is None else min(cap, s.output_tokens)
        live.req = SimRequest(live.pid, s.prompt_tokens, s.reuse_tokens, output, now,
                              shared=shared)
        self.c.requests += 1
        if self._front_s > 0:  # the fronts' time: the gateway sees it that much later
            self.loop.at(now + self._front_s, PRIO_WORKLOAD, self._at_gateway, live)
        else:
            self._at_gateway(live)

    def _at_gateway(self, live: _Live) -> None:
        assert live.req is not None
        self.policy.observe(RequestArrived(live.pid, live.req.prompt), self.loop.now)
        self._decide()

    def _decide(self) -> None:
        t0 = time.perf_counter()
        if self.config.engine_queues:
            self.policy.set_engine_queues([e.queued for e in self.engines], self.loop.now)
        decisions = self.policy.decide(self.loop.now)
        self.c.policy_time_s += time.perf_counter() - t0
        self.c.decisions += 1
        self.executor.execute(self.loop.now, decisions)

    # -- the engine actions the executor carries out (EngineTarget) ---------------------
    def submit(self, program_id: str, replica: int, reload: bool) -> None:
        live = self.live[program_id]
        assert live.req is not None, f"forward of {program_id} without a held request"
        self.c.held.append(self.loop.now - live.req.arrived - self._front_s)
        live.req.switched = self.c.churn.forwarded(program_id, replica)
        self.engines[replica].submit(live.req)

    def set_label(self, program_id: str, replica: int, label: KVLabel) -> None:
        self.engines[replica].set_label(program_id, label)

    def offload(self, program_id: str, replica: int) -> None:
        self.engines[replica].evict(program_id)  # to the CPU pool if there is one

    def drop(self, program_id: str, replica: int) -> None:
        self.engines[replica].drop(program_id)

    def release(self, program_id: str) -> None:
        for e in self.engines:
            e.release(program_id)

    # -- engine listener ----------------------------------------------------------------
    def kv_ready(self, req: SimRequest, now: float) -> None:
        self.policy.observe(KVReady(req.program_id), now)

    def first_token(self, req: SimRequest, now: float) -> None:
        self.c.ttft.append(now - req.arrived)

    def produced(self, tokens: int, now: float) -> None:
        self.c.output_tokens += tokens

    def finished(self, req: SimRequest, now: float) -> None:
        live = self.live[req.program_id]
        live.req = None
        self.c.steps += 1
        self.policy.observe(StepFinished(live.pid, req.prompt + req.output), now)
        nxt = live.advance()
        if nxt.end:
            self._end(live)
            return
        self._decide()
        if nxt.subagents:
            for sp in nxt.subagents:
                self.loop.at(now + sp.delay_s, PRIO_WORKLOAD, self._start, sp.program, None, live)
        else:
            self.loop.at(now + nxt.gap_s, PRIO_WORKLOAD, self._send, live)

    def _end(self, live: _Live) -> None:
        now = self.loop.now
        self.policy.observe(ProgramEnded(live.pid), now)
        self._decide()
        del self.live[live.pid]
        self.c.churn.ended(live.pid)
        self.c.programs_finished += 1
        parent = live.parent
        if parent is not None:
            assert isinstance(parent, _Live)
            gap = parent.subagent_ended()
            if gap is not None:
                self.loop.at(now + gap, PRIO_WORKLOAD, self._send, parent)
        elif live.slot is not None:
            self._start_slot(live.slot)

    # -- results ------------------------------------------------------------------------
    def _result(self, wall: float) -> RunResult:
        cfg, c, done = self.config, self.c, self.executor.counts
        dur = cfg.duration_s
        st = [e.stats for e in self.engines]
        prompt = sum(s.prompt_tokens for s in st)
        busy = [min(1.0, s.busy_s / dur) for s in st]
        page = self.cost.preset.page_tokens
        # requests sent but not answered (held by the policy or queued in an engine)
        waits = [dur - live.req.arrived for live in self.live.values()
                 if live.req is not None and live.req.first_token_at is None]
        mean, p50, p90, p99 = ttft_stats(c.ttft)
        return RunResult(
            config=cfg, traces=self.trace_name,
            max_context=context_cut(cfg),
            output_tokens=c.output_tokens, output_tokens_per_s=c.output_tokens / dur,
            steps=c.steps, steps_per_s=c.steps / dur, requests=c.requests,
            programs_started=c.programs_started, programs_finished=c.programs_finished,
            ttft_mean_s=mean, ttft_p50_s=p50, ttft_p90_s=p90, ttft_p99_s=p99,
            requests_waiting_at_end=len(waits),
            wait_max_at_end_s=max(waits, default=0.0),
            ttft_p99_with_waiting_s=percentile(c.ttft + waits, 99),
            held_mean_s=sum(c.held) / len(c.held) if c.held else float("nan"),
            gpu_busy_frac=sum(busy) / len(busy), gpu_busy_frac_per_replica=busy,
            running_requests_per_replica=[s.running_area / dur for s in st],
            churn_programs_frac=len(c.churn.switched) / max(1, c.programs_started),
            switches_per_program=c.churn.switches / max(1, c.programs_started),
            switch_recomputed_tokens=sum(s.switch_recomputed_tokens for s in st),
            gpu_hit_rate=sum(s.gpu_hit_tokens for s in st) / prompt if prompt else 0.0,
            cpu_hit_rate=sum(s.cpu_hit_tokens for s in st) / prompt if prompt else 0.0,
            disk_hit_rate=sum(s.disk_hit_tokens for s in st) / prompt if prompt else 0.0,
            disk_read_tokens=sum(s.disk_hit_tokens for s in st),
            disk_written_bytes=sum(s.disk_written_tokens for s in st) * self.kv_bytes,
            prompt_tokens=prompt, prefill_tokens=sum(s.prefill_tokens for s in st),
            recomputed_tokens=sum(s.recomputed_tokens for s in st),
            reloaded_tokens=sum(s.cpu_hit_tokens for s in st),
            promotions=sum(done.promotions.values()),
            demotions_to_cpu=done.demotions[Tier.CPU],
            demotions_to_disk=done.demotions[Tier.DISK],
            demotions_to_none=done.demotions[Tier.NONE], decisions=c.decisions,
            policy_time_per_decision_us=1e6 * c.policy_time_s / max(1, c.decisions),
            gpu_kv_capacity_tokens=self.gpu_pages * page,
            cpu_kv_capacity_tokens=self.cpu_pages * page,
            disk_kv_capacity_tokens=self.disk_pages * page,
            programs_left_out=self.left_out, events=self.loop.events_run, wall_s=wall,
            sim_seconds_per_wall_second=dur / wall if wall > 0 else float("inf"),
        )


def simulate(config: SimConfig, traces: TraceSet) -> RunResult:
    """Run one simulation and return its metrics."""
    return Simulation(config, traces).run()
