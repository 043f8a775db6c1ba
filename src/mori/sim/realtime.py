"""The simulator's engine replica run against the real clock (no HTTP library here).

``RealtimeReplica`` owns one ``EngineReplica`` (``mori.sim.replica_model``, unchanged), its
``KVPools`` and an ``EventLoop``, and maps wall time onto simulated time:

    simulated now = (monotonic now - t0) * time_scale

An asyncio driver task sleeps until the next event of the loop's heap (scaled to wall
time), then runs the loop up to the simulated now. A new request first advances the
loop to now, is then submitted, then the driver is woken. Events run at their own
simulated instants, so the model's results do not depend on how late the driver wakes;
only what a client sees (when a token is sent) is late by the scheduling jitter.

Token pacing: the first token is due when the simulated prefill ends; later tokens as
decode iterations complete. The replica advances a pure-decode stretch in one event (a
closed form), so inside a stretch a request's progress is computed from the running
segment (``EngineReplica.decode_run_progress``, i.e. ``CostModel.decode_iters_within``)
and a streaming client sleeps until the next iteration boundary; at every event the
driver wakes all waiting streams. Tokens due within ``min_emit_interval_s`` of wall time
of each other are sent together.

Requests come in tokens: the HTTP server (``mori.enginesim``) counts prompts by the rule
of ``mori.protocol.tokens``. A request the engine cannot take raises ``RequestError``
(``mori.protocol.errors``) with the status and code OpenAI would answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mori.core.costmodel import CostModel, get_preset
from mori.core.types import KVLabel
from mori.protocol.errors import RequestError
from mori.sim.clock import EventLoop
from mori.sim.kvcache import KVPools
from mori.sim.replica_model import EngineReplica, SimRequest
from mori.sim.script import Script


@dataclass(frozen=True, slots=True)
class EngineSimConfig:
    """One simulated engine replica served in real time.

    ``preset``: a hardware preset (``mori presets``). ``time_scale``: simulated seconds
    per wall second (100 runs the model 100x faster than the hardware it models).
    ``cpu_ratio``: the CPU KV tier as a multiple of the GPU pool (0: none), pages as in
    ``Simulation``. ``typed_eviction``: evict and admit by busy/idle/inactive label
    (MORI's engine), else plain LRU. ``gpu_kv_tokens``: override the preset's GPU KV
    pool (a small pool for tests). ``model_name``: the served model name (default: the
    preset's model). ``max_queue``: the most requests waiting for admission (0: no limit);
    more are refused with 503. ``min_emit_interval_s``: tokens due this close together
    (wall seconds) are sent in one write. ``script``: the answers' text and tool calls
    (``mori.sim.script``; None: placeholder text).
    """

    preset: str
    time_scale: float = 1.0
    cpu_ratio: float = 0.0
    typed_eviction: bool = False
    gpu_kv_tokens: int | None = None
    model_name: str | None = None
    max_queue: int = 0
    min_emit_interval_s: float = 0.001
    script: Script | None = None

    def __post_init__(self) -> None:
        get_preset(self.preset)  # UnknownNameError lists the presets
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be a positive number, got {self.time_scale}")
        if not (self.cpu_ratio >= 0 and math.isfinite(self.cpu_ratio)):
            raise ValueError(f"cpu_ratio must be >= 0, got {self.cpu_ratio}")
        if self.gpu_kv_tokens is not None and self.gpu_kv_tokens <= 0:
            raise ValueError(f"gpu_kv_tokens must be positive, got {self.gpu_kv_tokens}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.min_emit_interval_s < 0:
            raise ValueError("min_emit_interval_s must be >= 0")


# -- the engine --------------------------------------------------------------------------

@dataclass(eq=False, slots=True)
class Track:
    """One request in the real-time engine, as its HTTP handler follows it."""

    req: SimRequest
    anonymous: bool  # no program id was given: a one-shot program
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    cached_tokens: int = 0  # prompt tokens whose KV was found (GPU + CPU), set at kv_ready
    kv_ready_at: float | None = None  # simulated time the KV was in place
    first_token_at: float | None = None  # simulated times
    finished_at: float | None = None
    aborted: bool = False

    @property
    def done(self) -> bool:
        return self.finished_at is not None or self.aborted


@dataclass(slots=True)
class RequestCounters:
    """What happened to the requests the engine was sent (the server's own counts)."""

    requests: int = 0  # submitted
    finished: int = 0
    aborted: int = 0
    refused: int = 0
    generation_tokens: int = 0


class RealtimeReplica:
    """An ``EngineReplica`` driven by the wall clock. ``start()`` (idempotent) from a
    running event loop, ``submit()`` requests, ``await stop()`` at the end."""

    def __init__(self, config: EngineSimConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.preset = get_preset(config.preset)
        self.cost = CostModel(self.preset)
        self.page = self.preset.page_tokens
        gpu_tokens = config.gpu_kv_tokens or self.preset.gpu_kv_capacity_tokens
        self.gpu_pages = gpu_tokens // self.page
        if self.gpu_pages <= 0:
            raise ValueError(f"gpu_kv_tokens must hold at least one page of {self.page} tokens")
        self.cpu_pages = int(self.gpu_pages * config.cpu_ratio)
        self.model_name = config.model_name or self.preset.model.name
        self.kv_bytes_per_token = self.preset.kv_bytes_per_token_per_gpu * self.preset.tp
        self.loop = EventLoop()
        self.pools = KVPools(self.gpu_pages, self.cpu_pages, config.typed_eviction)
        self.replica = EngineReplica(0, self.cost, self.loop, self.pools, self,
                                     typed_admission=config.typed_eviction)
        self.counters = RequestCounters()
        self._clock = clock
        self._t0: float | None = None
        self._tracks: dict[SimRequest, Track] = {}
        self._context: dict[str, int] = {}  # program -> prompt + output of its last request
        self._ids = itertools.count(1)
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None

    # -- clocks ---------------------------------------------------------------------------
    def sim_now(self) -> float:
        if self._t0 is None:
            return 0.0
        return (self._clock() - self._t0) * self.config.time_scale

    def wall_delay(self, sim_t: float) -> float:
        """Wall seconds from now until simulated time ``sim_t`` (>= 0)."""
        return max(0.0, (sim_t - self.sim_now()) / self.config.time_scale)

    def sync(self) -> None:
        """Run the model's events up to the simulated now; wake the streams if any ran."""
        now = self.sim_now()
        if now <= self.loop.now:
            return
        before = self.loop.events_run
        self.loop.run(now)
        if self.loop.events_run != before:
            for t in self._tracks.values():
                t.changed.set()

    # -- life cycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the clock and the driver task (needs a running event loop)."""
        if self._driver is not None:
            return
        if self._t0 is None:
            self._t0 = self._clock()
        self._wake = asyncio.Event()
        self._driver = asyncio.get_running_loop().create_task(self._drive(),
                                                              name="mori-engine-sim")

    async def stop(self) -> None:
        task, self._driver = self._driver, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.abort_all()

    def abort_all(self) -> None:
        """Abort every request in flight (the server is going away)."""
        for t in list(self._tracks.values()):
            self.abort(t)

    async def _drive(self) -> None:
        assert self._wake is not None
        wake = self._wake
        while True:
            wake.clear()
            self.sync()
            nxt = self.loop.next_time()
            if nxt is None:
                await wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), self.wall_delay(nxt))

    def _kick_driver(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # -- requests -------------------------------------------------------------------------
    def check_fits(self, prompt: int, output: int) -> None:
        """Refuse a request that could never be admitted (it would block the queue)."""
        window = self.preset.model.context_window
        if prompt + output > window:
            raise RequestError(
                400, f"This model's maximum context length is {window} tokens. However, "
                f"you requested {prompt + output} tokens ({prompt} in the messages, {output} "
                "in the completion).", "messages", "context_length_exceeded")
        pages = -(-(prompt + output) // self.page)
        if pages > self.gpu_pages:
            raise RequestError(
                400, f"the request needs {pages * self.page} tokens of KV cache but the "
                f"engine's GPU pool holds {self.gpu_pages * self.page}", "messages",
                "context_length_exceeded")

    def submit(self, program_id: str | None, prompt: int, output: int,
               reuse: int | None = None) -> Track:
        """Queue a request now. ``program_id`` None: a one-shot program. ``reuse``: the
        reusable prefix (None: the program's previous context if the prompt extends it)."""
        if prompt < 1 or output < 1:
            raise RequestError(400, "prompt and output must be at least one token")
        self.check_fits(prompt, output)
        max_queue = self.config.max_queue
        if max_queue and len(self.replica.waiting) >= max_queue:
            self.counters.refused += 1
            raise RequestError(503, f"the engine's queue is full ({max_queue} waiting)",
                               code="overloaded", type_="server_error")
        self.start()
        self.sync()
        anonymous = program_id is None or self._busy(program_id)
        if program_id is None:
            pid = f"req-{next(self._ids)}"
        elif anonymous:  # one request per program at a time: a concurrent one stands alone
            pid = f"{program_id}~{next(self._ids)}"
        else:
            pid = program_id
        if reuse is None:
            ctx = 0 if anonymous else self._context.get(pid, 0)
            reuse = ctx if prompt >= ctx else 0
        reuse = max(0, min(reuse, prompt))
        req = SimRequest(pid, prompt, reuse, output, arrived=self.loop.now)
        track = Track(req, anonymous)
        self._tracks[req] = track
        self.counters.requests += 1
        self.replica.submit(req)
        self._kick_driver()
        return track

    def _busy(self, program_id: str) -> bool:
        return any(t.req.program_id == program_id for t in self._tracks.values())

    def abort(self, track: Track) -> bool:
        """The client went away: cancel the request and unpin its KV. False if done."""
        self.sync()
        if track.done:
            return False
        track.aborted = True
        self._tracks.pop(track.req, None)
        self.replica.abort(track.req)
        self.counters.aborted += 1
        if track.anonymous:
            self.replica.release(track.req.program_id)
        track.changed.set()
        self._kick_driver()
        return True

    def tokens_done(self, track: Track) -> int:
        """Output tokens of ``track`` produced by the loop's time (``sync`` first)."""
        r = track.req
        if track.finished_at is not None:
            return r.output
        if track.first_token_at is None:
            return 0
        n = r.decoded
        if r in self.replica.decode:
            prog = self.replica.decode_run_progress(self.loop.now)
            if prog is not None:
                n += prog[0]
        return min(n, r.output - 1)  # the last token comes with the finish event

    def next_token_time(self, track: Track) -> float | None:
        """Simulated time the next token of ``track`` inside a decode run is due, if known
        (other changes come with events, which wake the stream)."""
        if track.first_token_at is None or track.done:
            return None
        if track.req not in self.replica.decode:
            return None
        prog = self.replica.decode_run_progress(self.loop.now)
        return None if prog is None else prog[1]

    async def wait_change(self, track: Track, timeout: float | None) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(track.changed.wait(), timeout)

    # -- EngineListener -------------------------------------------------------------------
    def kv_ready(self, req: SimRequest, now: float) -> None:
        t = self._tracks.get(req)
        if t is not None:
            t.cached_tokens = req.cached
            t.kv_ready_at = now
            t.changed.set()

    def first_token(self, req: SimRequest, now: float) -> None:
        t = self._tracks.get(req)
        if t is not None:
            t.first_token_at = now
            t.changed.set()

    def produced(self, tokens: int, now: float) -> None:
        self.counters.generation_tokens += tokens

    def finished(self, req: SimRequest, now: float) -> None:
        t = self._tracks.pop(req, None)
        self.counters.finished += 1
        if t is None:
            return
        t.finished_at = now
        t.changed.set()
        if t.anonymous:
            self.replica.release(req.program_id)
        else:
            self._context[req.program_id] = req.prompt + req.output

    # -- KV controls ----------------------------------------------------------------------
    def known(self, program_id: str) -> bool:
        return program_id in self.pools.entries

    def set_label(self, program_id: str, label: KVLabel) -> None:
        self.sync()
        self.replica.set_label(program_id, label)

    def offload(self, program_id: str) -> None:
        self.sync()
        self.replica.evict(program_id)
        self._kick_driver()

    def drop(self, program_id: str) -> None:
        """Forget a program's KV in both tiers (not pages a running request holds)."""
        self.sync()
        self.replica.drop(program_id)
        self._kick_driver()

    def release(self, program_id: str) -> None:
        self.sync()
        self.replica.release(program_id)
        self._context.pop(program_id, None)
        self._kick_driver()

    def program_state(self, program_id: str) -> dict[str, Any]:
        e = self.pools.entries.get(program_id)
        if e is None:
            return {"program_id": program_id, "gpu_tokens": 0, "cpu_tokens": 0,
                    "label": None, "pinned": False}
        return {"program_id": program_id, "gpu_tokens": e.gpu * self.page,
                "cpu_tokens": e.cpu * self.page, "label": e.label.value, "pinned": e.pinned}

    # -- reports --------------------------------------------------------------------------
    def residency(self) -> dict[str, Any]:
        self.sync()
        entries = self.pools.entries.values()
        return {"gpu_tokens": {e.program_id: e.gpu * self.page for e in entries if e.gpu},
                "cpu_tokens": {e.program_id: e.cpu * self.page for e in entries if e.cpu},
                # released programs whose KV is still held (inactive, evicted first)
                "ended": sorted(e.program_id for e in entries if e.ended
                                and (e.gpu or e.cpu))}

    def capacity(self) -> dict[str, int]:
        return {"gpu_tokens": self.gpu_pages * self.page, "cpu_tokens": self.cpu_pages * self.page,
                "page_tokens": self.page, "kv_bytes_per_token": self.kv_bytes_per_token}

    @property
    def running(self) -> int:
        return self.replica.running

    @property
    def waiting(self) -> int:
        return len(self.replica.waiting)

    def kv_usage(self) -> float:
        return self.pools.gpu_used / self.pools.gpu_cap

    def cpu_kv_usage(self) -> float:
        """The host tier's share in use: its CPU-only pages and its copies of the GPU
        pages that hold computed KV, over its size (the CPU pool beyond a full GPU's
        mirror, plus that mirror; ``mori.sim.kvcache``)."""
        p = self.pools
        if not p.cpu_cap:
            return 0.0
        return (p.cpu_used + p.gpu_used - p.unmirrored) / (p.cpu_cap + p.gpu_cap)

    def stats(self) -> dict[str, Any]:
        """The replica's ``EngineStats`` plus the live load and the server's counters."""
        self.sync()
        out: dict[str, Any] = dataclasses.asdict(self.replica.stats)
        out.update(dataclasses.asdict(self.counters))
        out.update(
            sim_time_s=self.loop.now, time_scale=self.config.time_scale,
            running=self.running, waiting=self.waiting, kv_usage=self.kv_usage(),
            cpu_kv_usage=self.cpu_kv_usage(), gpu_used_tokens=self.pools.gpu_used * self.page,
            cpu_used_tokens=self.pools.cpu_used * self.page, programs=len(self.pools.entries),
            evicted_gpu_tokens=self.pools.evicted_gpu_pages * self.page,
            dropped_tokens=self.pools.dropped_pages * self.page,
        )
        return out
