"""The closed-loop trace replayer as a real client of an OpenAI-compatible endpoint.

``replay(config, traces)`` replays agent programs against a MORI gateway or an engine
directly, with the simulator's replay rules (:mod:`mori.sim.plan`): N slots started at
seeded, staggered times, a seeded trace order, each program sending its next request
only after its previous response and its recorded gap, subagents spawned at their delay
while their parent waits, program ids ``f"{trace.name}#{k}"``.

Each request is a streamed chat completion with ``max_tokens`` = the step's output
tokens and MORI's request fields (see :mod:`mori.protocol.fields`): ``program_id`` and
``mori`` = ``{"prompt_tokens": P, "reuse_tokens": R}`` with a short placeholder message,
or, with ``text_prompts``, a prompt of about P tokens of text (4 characters a token) that
keeps the first R tokens of the program's previous prompt, for engines that do not honour
``mori``. Gaps are slept in wall time divided by ``time_scale``; every reported time is
in simulated seconds (wall x ``time_scale``). At a program's end the replayer POSTs
``/v1/programs/{id}/release`` (a target that answers 404, an engine, is not asked again).
After ``duration_s`` simulated seconds what is in flight is cancelled.

A failed request (an error answer, a refused or broken connection, a stream error event,
no answer within ``request_timeout_s``) is counted by kind; the program goes on after
its gap (or ends, with ``end_on_error``), never sooner than ``error_backoff_s``.

The settings and the plan are :mod:`mori.replay.config`; probing the target, its HTTP
client and the error kinds, :mod:`mori.replay.target`.
"""

from __future__ import annotations

import asyncio
import random
import string
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import openai
from openai.types.chat import ChatCompletionMessageParam

from mori.protocol.tokens import CHARS_PER_TOKEN
from mori.replay.config import ReplayConfig, build_plan, context_limit
from mori.replay.metrics import GatewayCounters, ReplayResult, RequestRecord
from mori.replay.target import Target, error_kind, http_client, probe_target, scrape_counters
from mori.sim.metrics import ttft_stats
from mori.sim.plan import ProgramRun, ReplayPlan
from mori.traces.model import SubagentSpawn, TraceSet

_RELEASE_TIMEOUT_S = 10.0
_VOCAB = tuple("".join(t) for t in zip(*(random.Random(7).choices(string.ascii_lowercase, k=4096)
                                         for _ in range(3)), strict=True))


@dataclass(frozen=True, slots=True)
class ReplayProgress:
    """A snapshot during the run, for a progress display."""

    elapsed_s: float  # simulated seconds since the start
    duration_s: float
    requests: int
    steps: int
    errors: int
    live: int


# -- the replayer ----------------------------------------------------------------------
class _Replayer:
    """The live state of one replay (one asyncio task per slot, subagents inside)."""

    def __init__(self, cfg: ReplayConfig, plan: ReplayPlan, client: openai.AsyncOpenAI,
                 http: Any, model: str, headers: dict[str, str], gateway: bool) -> None:
        self.cfg = cfg
        self.plan = plan
        self.client = client
        self.http = http
        self.model = model
        self.headers = headers
        self.release_supported: bool | None = True if gateway else None
        self.release_probe = asyncio.Lock()
        self.t0 = 0.0
        self.live: dict[str, ProgramRun] = {}
        self.texts: dict[str, str] = {}
        self.requests = self.steps = self.output_tokens = 0
        self.started = self.finished = self.release_errors = 0
        self.errors: Counter[str] = Counter()
        self.ttft: list[float] = []
        self.events: list[RequestRecord] = []

    # time
    def now(self) -> float:
        """Simulated seconds since the start."""
        return (time.monotonic() - self.t0) * self.cfg.time_scale

    async def sleep(self, sim_s: float) -> None:
        if sim_s > 0:
            await asyncio.sleep(sim_s / self.cfg.time_scale)

    def tokens(self, n: int) -> int:
        return n if self.cfg.token_scale == 1.0 else max(1, round(n * self.cfg.token_scale))

    # programs
    async def slot(self, slot: int, start_s: float) -> None:
        await self.sleep(start_s)
        while True:
            await self.program(self.plan.start_slot(slot))

    async def program(self, run: ProgramRun) -> None:
        self.live[run.pid] = run
        self.started += 1
        while True:
            ok = await self.request(run)
            if not ok:
                await asyncio.sleep(self.cfg.error_backoff_s)
                if self.cfg.end_on_error:
                    break
            nxt = run.advance()
            if nxt.end:
                break
            if nxt.subagents:
                gaps = await asyncio.gather(*(self.subagent(sp, run) for sp in nxt.subagents))
                gap = next(g for g in gaps if g is not None)
            else:
                gap = nxt.gap_s
            await self.sleep(gap)
        del self.live[run.pid]
        self.texts.pop(run.pid, None)
        self.finished += 1
        await self.release(run.pid)

    async def subagent(self, spawn: SubagentSpawn, parent: ProgramRun) -> float | None:
        """Run one subagent; the parent's residual gap if it was the last to end."""
        await self.sleep(spawn.delay_s)
        await self.program(self.plan.start(spawn.program, None, parent))
        return parent.subagent_ended()

    # requests
    def messages(self, run: ProgramRun, prompt: int, reuse: int
                 ) -> list[ChatCompletionMessageParam]:
        if not self.cfg.text_prompts:
            return [{"role": "user", "content": f"{run.pid} step {run.step + 1}"}]
        prev = self.texts.get(run.pid, "")
        keep = prev[: min(len(prev), reuse * CHARS_PER_TOKEN)]
        if not keep:
            keep = f"program {run.pid}\n"
        need = prompt * CHARS_PER_TOKEN - len(keep)
        if need > 0:
            rng = random.Random(f"{run.pid}/{run.step}")
            words = rng.choices(_VOCAB, k=need // CHARS_PER_TOKEN + 1)
            keep += (" " + " ".join(words))[:need]
        self.texts[run.pid] = keep
        return [{"role": "user", "content": keep}]

    async def request(self, run: ProgramRun) -> bool:
        """Send the program's current step; True if it completed without error."""
        step, index = run.current, run.step
        prompt = self.tokens(step.prompt_tokens)
        reuse = min(self.tokens(step.reuse_tokens), prompt) if step.reuse_tokens else 0
        extra: dict[str, Any] = {"program_id": run.pid}
        if not self.cfg.text_prompts:
            extra["mori"] = {"prompt_tokens": prompt, "reuse_tokens": reuse}
        messages = self.messages(run, prompt, reuse)
        sent = self.now()
        self.requests += 1
        first: float | None = None
        end: float | None = None
        received = 0
        usage: int | None = None
        prompt_used: int | None = None
        cached: int | None = None
        error: str | None = None
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                stream = await self.client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=self.tokens(step.output_tokens),
                    stream=True, stream_options={"include_usage": True}, extra_body=extra)
                try:
                    async for chunk in stream:
                        if chunk.usage is not None:
                            if chunk.usage.completion_tokens is not None:
                                usage = chunk.usage.completion_tokens
                            prompt_used, cached = _prompt_usage(chunk.usage)
                        for choice in chunk.choices:
                            d = choice.delta
                            extra_d = d.model_extra or {}
                            if d.content or d.tool_calls or extra_d.get("reasoning_content"):
                                if first is None:
                                    first = self.now()
                                    self.ttft.append(first - sent)
                                received += 1
                                self.output_tokens += 1
                finally:
                    await stream.close()
            if usage is not None:  # the server's count is the truth
                self.output_tokens += usage - received
                received = usage
            end = self.now()
            self.steps += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = error_kind(e, first is not None)
        finally:
            if error is not None:
                end = self.now()
                self.errors[error] += 1
            self.events.append(RequestRecord(run.pid, index, sent, first, end, received, error,
                                             prompt_used, cached))
        return error is None

    async def release(self, pid: str) -> None:
        """Tell the target the program ended (until it says it has no such endpoint)."""
        if self.release_supported is None:
            async with self.release_probe:  # the first call tells; the others wait for it
                if self.release_supported is None:
                    await self._release(pid)
                    return
        if self.release_supported:
            await self._release(pid)

    async def _release(self, pid: str) -> None:
        url = f"{self.cfg.base_url}/v1/programs/{quote(pid, safe='')}/release"
        try:
            r = await self.http.post(url, headers=self.headers, timeout=_RELEASE_TIMEOUT_S)
        except Exception:
            self.release_errors += 1
            return
        if r.status_code in (404, 405, 501):
            self.release_supported = False
        elif r.status_code >= 400:
            self.release_errors += 1
        else:
            self.release_supported = True

    def progress(self) -> ReplayProgress:
        return ReplayProgress(min(self.now(), self.cfg.duration_s), self.cfg.duration_s,
                              self.requests, self.steps, sum(self.errors.values()),
                              len(self.live))


def _prompt_usage(usage: Any) -> tuple[int | None, int | None]:
    """``(prompt_tokens, cached_tokens)`` of a usage object (None where not reported)."""
    prompt = getattr(usage, "prompt_tokens", None)
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return (prompt if isinstance(prompt, int) else None,
            cached if isinstance(cached, int) else None)


async def replay(config: ReplayConfig, traces: TraceSet,
                 progress: Callable[[ReplayProgress], None] | None = None,
                 progress_interval_s: float = 0.5) -> ReplayResult:
    """Replay ``traces`` against ``config.target`` for ``config.duration_s`` simulated
    seconds; ``progress`` is called about every ``progress_interval_s`` wall seconds.

    Raises :class:`TargetError` if the target cannot be reached or lists no model, and
    :class:`ReplaySettingsError` if no program fits the context window.
    """
    cfg = config
    headers = {"Authorization": f"Bearer {cfg.api_key}"}
    http = http_client(cfg.programs, cfg.request_timeout_s)
    wall0 = time.perf_counter()
    try:
        client = openai.AsyncOpenAI(base_url=f"{cfg.base_url}/v1", api_key=cfg.api_key,
                                    http_client=http, max_retries=0,
                                    timeout=cfg.request_timeout_s)
        target = await probe_target(client, http, cfg, headers)
        max_context = context_limit(cfg, target.max_model_len)
        plan = build_plan(cfg, traces, max_context)
        r = _Replayer(cfg, plan, client, http, target.model, headers, target.gateway)
        r.t0 = time.monotonic()
        tasks = [asyncio.create_task(r.slot(i, s)) for i, s in enumerate(plan.start_times)]
        try:
            end = r.t0 + cfg.duration_s / cfg.time_scale
            while (left := end - time.monotonic()) > 0:
                await asyncio.sleep(min(left, progress_interval_s))
                for t in tasks:  # a slot task only stops on a bug: say so now
                    if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
                        raise exc
                if progress is not None:
                    progress(r.progress())
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks, timeout=10.0)
        wall = time.perf_counter() - wall0
        counters = await scrape_counters(http, cfg.base_url, headers) if target.gateway else None
        if r.release_supported and r.live:  # still running at the end: let the target know
            await asyncio.wait([asyncio.create_task(r.release(pid)) for pid in r.live],
                               timeout=_RELEASE_TIMEOUT_S)
        return _result(cfg, traces, plan, r, target, counters, wall, max_context)
    finally:
        await http.aclose()


def _result(cfg: ReplayConfig, traces: TraceSet, plan: ReplayPlan, r: _Replayer,
            target: Target, end: GatewayCounters | None, wall: float,
            max_context: int | None) -> ReplayResult:
    dur = cfg.duration_s
    mean, p50, p90, p99 = ttft_stats(r.ttft)
    start = target.counters or GatewayCounters()
    end = end or GatewayCounters()
    return ReplayResult(
        target=cfg.base_url, model=target.model, gateway=target.gateway, traces=traces.name,
        programs=cfg.programs, duration_s=dur, time_scale=cfg.time_scale, seed=cfg.seed,
        stagger_s=cfg.stagger_s, human_gap=cfg.human_gap, human_gap_cap_s=cfg.human_gap_cap_s,
        max_context=max_context, text_prompts=cfg.text_prompts, token_scale=cfg.token_scale,
        output_tokens=r.output_tokens, output_tokens_per_s=r.output_tokens / dur,
        steps=r.steps, steps_per_s=r.steps / dur, requests=r.requests,
        programs_started=r.started, programs_finished=r.finished,
        ttft_mean_s=mean, ttft_p50_s=p50, ttft_p90_s=p90, ttft_p99_s=p99,
        errors=dict(sorted(r.errors.items())), error_count=sum(r.errors.values()),
        release_errors=r.release_errors,
        promotions=_delta(end.promotions, start.promotions),
        demotions_to_cpu=_delta(end.demotions_to_cpu, start.demotions_to_cpu),
        demotions_to_none=_delta(end.demotions_to_none, start.demotions_to_none),
        held_requests=_delta(end.held_requests, start.held_requests),
        demotions_to_disk=_delta(end.demotions_to_disk, start.demotions_to_disk),
        programs_left_out=plan.left_out, wall_s=wall,
        events=tuple(sorted(r.events, key=lambda e: (e.sent_s, e.program_id, e.step))),
    )


def _delta(end: int | None, start: int | None) -> int | None:
    if end is None:
        return None
    return end - (start or 0)
