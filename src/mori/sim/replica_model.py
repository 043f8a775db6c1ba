"""A simulated engine replica: continuous batching over a paged GPU/CPU KV cache.

What it models (docs/costmodel.md; the names follow SGLang):
- Admission: waiting requests enter in order (under typed eviction, by the admission
  order of ``mori.core.eviction_order``, the GPU's reversed; docs/system.md, "Typed
  offloading in the engine"; otherwise first come first served). Admitting one pins
  its program's pages and reserves pages for prompt + output (the engine is told the
  output length; a real engine reserves an estimate); if the GPU cannot be made to hold
  them by evicting unpinned pages, admission stops (head-of-line), as SGLang does.
- Prefix reuse: only the step's reusable prefix (from the trace's block hashes) can hit;
  hits on the GPU are free, hits on the CPU are reloaded over PCIe (one host-to-device
  link per replica, first come first served; it overlaps with compute), hits on the disk
  are read back over the replica's disk link (pipelined through host memory to the GPU,
  ``CostModel.disk_read_time``), the rest of the prompt is prefilled. At least one token
  is always computed.
- The disk link (a replica with a disk tier): one queue for reads and writes, first come
  first served: pages the CPU pool evicts to disk take it for their write, a read waits
  behind the writes before it. An approximation: an NVMe drive serves reads and writes
  concurrently, sharing its bandwidth; the write is charged when the pages leave the host
  pool, whose room is taken back at once (as if a staging buffer held them).
- Request overhead: the iteration that starts a request's prefill takes the preset's
  ``request_overhead_s`` longer for it (the API server's HTTP, tokenization and output
  path, which on the CPU engine share the engine's CPU; 0 for the GPU presets, whose API
  server runs beside the GPU). An approximation: the real path runs partly before the
  request is queued and partly after its last token.
- Reloads on the engine (the preset's ``reload_on_engine``, the CPU build, whose host
  tier is copied by the engine's own CPU): a reload is not put on a link beside the
  compute but added to the iteration that starts the request's prefill, as engine time.
- Iterations: a prefill chunk (``chunk_size`` tokens, first come first served across
  requests) plus one decode token for every running request, timed by the cost model.
  Pure-decode stretches are advanced in one event to the next change (a request ends, or
  a new request becomes ready, which cuts the stretch at the iteration boundary).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from mori.core.costmodel import CostModel, prefill_attn_ctx
from mori.core.eviction_order import admission_rank
from mori.core.hardware import DiskSpec
from mori.core.types import KVLabel
from mori.sim.clock import PRIO_ENGINE, EventLoop
from mori.sim.kvcache import KVEntry, KVPools

_ADMISSION_RANK = {label: admission_rank(label) for label in KVLabel}


@dataclass(slots=True, eq=False)
class SimRequest:
    """One LLM call inside the simulated engine."""

    program_id: str
    prompt: int
    reuse: int
    output: int
    arrived: float  # when it reached the scheduler (TTFT counts from here)
    shared: int = 0  # leading tokens served by the cross-program shared prefix, if modelled
    seq: int = 0
    cached: int = 0  # prompt tokens whose KV exists on the GPU
    remaining: int = 0  # prompt tokens still to prefill
    decoded: int = 0
    first_token_at: float | None = None
    switched: bool = False  # forwarded to another replica than the program's last step
    started: bool = False  # its prefill has begun (its request overhead is charged)
    reload_s: float = 0.0  # a reload the engine itself does (``reload_on_engine``), charged then
    pages: int = 0  # GPU pages it holds (prompt + output), set at admission
    held: int = 0  # of those, the pages that held KV at admission
    aborted: bool = False  # the client went away (real-time engine only; see abort())
    entry: KVEntry | None = field(default=None, repr=False)


class EngineListener(Protocol):
    """What the engine reports to whoever drives it."""

    def kv_ready(self, req: SimRequest, now: float) -> None: ...
    def first_token(self, req: SimRequest, now: float) -> None: ...
    def finished(self, req: SimRequest, now: float) -> None: ...
    def produced(self, tokens: int, now: float) -> None: ...


@dataclass(slots=True)
class EngineStats:
    busy_s: float = 0.0
    iterations: int = 0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0  # reloaded from the CPU pool
    disk_hit_tokens: int = 0  # read back from the disk pool
    disk_written_tokens: int = 0  # written to the disk pool
    recomputed_tokens: int = 0  # reusable tokens that had been lost and were prefilled again
    prefill_tokens: int = 0
    admitted: int = 0
    switch_recomputed_tokens: int = 0  # of recomputed_tokens, those lost to a replica switch
    running_area: float = 0.0  # integral of running requests over busy time


class EngineReplica:
    def __init__(self, index: int, cost: CostModel, loop: EventLoop, pools: KVPools,
                 listener: EngineListener, typed_admission: bool,
                 disk: DiskSpec | None = None) -> None:
        self.index = index
        self.cost = cost
        self.loop = loop
        self.pools = pools
        self.listener = listener
        self.typed_admission = typed_admission
        self.page = cost.preset.page_tokens
        self.chunk = cost.preset.chunk_size
        self.stats = EngineStats()
        self.waiting: list[SimRequest] = []
        self.prefill: deque[SimRequest] = deque()
        self.decode: list[SimRequest] = []
        # over ``decode``: the sum of prompt + decoded, and the least output left (None:
        # to recompute), kept as requests join, advance and leave
        self._dctx = 0
        self._dleft: int | None = None
        self.loading = 0
        self._link_free = 0.0
        self.disk = disk  # the disk tier's drive(s), when pools has a disk pool
        self._disk_free = 0.0  # when the disk link is next free
        self._busy = False
        self._version = 0
        self._seg: tuple[float, int, int, int] | None = None  # decode run: start, B, S0, n
        self._seq = 0

    # -- interface used by the driver -------------------------------------------------
    @property
    def queued(self) -> int:
        """Requests the engine has waiting: not admitted yet, or admitted and loading
        their KV (what vLLM counts in ``num_requests_waiting``)."""
        return len(self.waiting) + self.loading

    def submit(self, req: SimRequest) -> None:
        self._seq += 1
        req.seq = self._seq
        self.waiting.append(req)
        self._kick()

    def set_label(self, program_id: str, label: KVLabel) -> None:
        self.pools.set_label(self.pools.entry(program_id), label)

    def evict(self, program_id: str) -> None:
        """Drop a program's GPU pages now (to the CPU pool if the engine has one)."""
        self.pools.evict_program_gpu(program_id, self.loop.now)
        self._charge_writes(self.loop.now)

    def drop(self, program_id: str) -> None:
        """Forget a program's KV in both tiers now (not pages a running request holds)."""
        e = self.pools.entries.get(program_id)
        if e is not None and not e.pinned:
            self.pools.truncate(e, 0)
            if e.ended:
                self.pools.remove(program_id)

    def release(self, program_id: str) -> None:
        e = self.pools.entries.get(program_id)
        if e is not None:
            self.pools.set_label(e, KVLabel.INACTIVE)
            self.pools.end(e)
            if not e.gpu and not e.cpu and not e.disk and not e.pinned:
                self.pools.remove(program_id)

    def abort(self, req: SimRequest) -> bool:
        """Cancel ``req`` (its client went away): take it out of the queue or the batch
        and unpin its program's KV, keeping only the pages it has computed. False if it
        had already finished or been aborted. The replay never aborts, so the simulator's
        results do not depend on this; the real-time engine (``mori.engines``) uses it."""
        if req.aborted or (req.entry is not None and req.decoded >= req.output):
            return False
        req.aborted = True
        if req.entry is None:  # still waiting for admission
            self.waiting.remove(req)
            return True
        if req in self.prefill:
            self.prefill.remove(req)
        elif req in self.decode:
            self.decode.remove(req)  # the iteration in flight still counts it; see _kick
            self._dctx -= req.prompt + req.decoded
            self._dleft = None
        # else: its KV is being reloaded; _loaded drops it
        e = req.entry
        self.pools.truncate(e, (req.cached + req.decoded) // self.page)  # free the reserve
        self.pools.unpin(e, self.loop.now)  # what it computed is written
        if e.ended and not e.gpu and not e.cpu and not e.disk:
            self.pools.remove(e.program_id)
        self._kick()  # admit what now fits; a decode run ends at its next boundary
        return True

    def decode_run_progress(self, now: float) -> tuple[int, float] | None:
        """In a pure-decode run: the iterations it has completed by ``now`` and the time
        its next iteration ends; None otherwise. Read only (real-time token streaming)."""
        if self._seg is None:
            return None
        start, batch, ctx0, n = self._seg
        done = min(n, self.cost.decode_iters_within(batch, ctx0, now - start))
        return done, start + self.cost.decode_run_time(batch, ctx0, min(n, done + 1))

    @property
    def running(self) -> int:
        return len(self.prefill) + len(self.decode) + self.loading

    # -- the iteration loop ------------------------------------------------------------
    def _kick(self) -> None:
        if not self._busy:
            self._start()
        elif self._seg is not None:
            self._cut_decode_run()

    def _start(self) -> None:
        now = self.loop.now
        self._seg = None
        self._admit(now)
        if self.prefill:
            self._mixed_iteration(now)
        elif self.decode:
            batch = len(self.decode)
            ctx0 = self._dctx
            n = self._dleft
            if n is None:
                n = min(r.output - r.decoded for r in self.decode)
            self._seg = (now, batch, ctx0, n)
            self._schedule(now + self.cost.decode_run_time(batch, ctx0, n), self._end_decode, n)
        else:
            self._busy = False

    def _schedule(self, t: float, fn: object, *args: object) -> None:
        self._busy = True
        self._version += 1
        self.loop.at(t, PRIO_ENGINE, self._fire, self._version, fn, args)

    def _fire(self, version: int, fn: object, args: tuple[object, ...]) -> None:
        if version == self._version:
            fn(*args)  # type: ignore[operator]

    def _cut_decode_run(self) -> None:
        """A request became ready mid decode run: end the run at the next boundary."""
        assert self._seg is not None
        start, batch, ctx0, n = self._seg
        done = self.cost.decode_iters_within(batch, ctx0, self.loop.now - start)
        if done + 1 >= n:
            return  # the run ends at the next boundary anyway
        self._seg = (start, batch, ctx0, done + 1)
        end = start + self.cost.decode_run_time(batch, ctx0, done + 1)
        self._schedule(max(end, self.loop.now), self._end_decode, done + 1)

    def _end_decode(self, n: int) -> None:
        assert self._seg is not None
        start = self._seg[0]
        now = self.loop.now
        self.stats.busy_s += now - start
        self.stats.running_area += self.running * (now - start)
        self.stats.iterations += n
        self._advance_decode(n, now)
        self._start()

    def _advance_decode(self, n: int, now: float) -> None:
        if not self.decode:
            return
        self.listener.produced(n * len(self.decode), now)
        still = []
        ctx = 0
        left: int | None = None
        for r in self.decode:
            r.decoded += n
            if r.decoded >= r.output:
                self._finish(r, now)
            else:
                still.append(r)
                ctx += r.prompt + r.decoded
                rest = r.output - r.decoded
                if left is None or rest < left:
                    left = rest
        self.decode = still
        self._dctx, self._dleft = ctx, left

    def _mixed_iteration(self, now: float) -> None:
        budget = self.chunk
        parts: list[tuple[SimRequest, int]] = []
        attn = 0.0
        for r in self.prefill:
            if budget <= 0:
                break
            n = min(r.remaining, budget)
            parts.append((r, n))
            attn += prefill_attn_ctx(n, r.cached)
            budget -= n
        new = sum(n for _, n in parts)
        batch = len(self.decode)
        ctx = self._dctx
        dt = self.cost.iteration_time(new, attn, batch, ctx)
        overhead = self.cost.request_overhead
        if overhead or self.cost.preset.reload_on_engine:  # else nothing to charge
            for r, _ in parts:
                if not r.started:
                    r.started = True
                    dt += overhead + r.reload_s
        self._schedule(now + dt, self._end_mixed, parts, dt)

    def _end_mixed(self, parts: list[tuple[SimRequest, int]], dt: float) -> None:
        now = self.loop.now
        self.stats.busy_s += dt
        self.stats.running_area += self.running * dt
        self.stats.iterations += 1
        self._advance_decode(1, now)
        for r, n in parts:
            if r.aborted:
                continue
            r.cached += n
            r.remaining -= n
            self._written(r, r.cached // self.page)
            if r.remaining == 0:
                self.prefill.remove(r)
                r.decoded = 1
                r.first_token_at = now
                self.listener.first_token(r, now)
                self.listener.produced(1, now)
                if r.decoded >= r.output:
                    self._finish(r, now)
                else:
                    self.decode.append(r)
                    self._dctx += r.prompt + r.decoded
                    rest = r.output - r.decoded
                    if len(self.decode) == 1 or (self._dleft is not None
                                                 and rest < self._dleft):
                        self._dleft = rest
        self._start()

    def _written(self, r: SimRequest, computed_pages: int) -> None:
        """``r``'s first ``computed_pages`` pages hold computed KV now: those of the
        pages it reserved are written through to the host tier (``KVPools.written``;
        the rest are when it ends)."""
        e = r.entry
        assert e is not None
        left = max(0, r.pages - max(r.held, computed_pages))
        if left < e.reserved:
            self.pools.written(e, e.reserved - left)

    def _finish(self, r: SimRequest, now: float) -> None:
        e = r.entry
        assert e is not None
        # engines keep whole blocks only: the last partial page is freed, not written
        self.pools.truncate(e, (r.prompt + r.decoded) // self.page)
        self.pools.unpin(e, now)
        self.listener.finished(r, now)

    # -- admission ---------------------------------------------------------------------
    def _admit(self, now: float) -> None:
        if not self.waiting:
            return
        if self.typed_admission:  # mori.core.eviction_order's admission order
            entry, rank = self.pools.entry, _ADMISSION_RANK
            self.waiting.sort(key=lambda r: (rank[entry(r.program_id).label], r.seq))
        admitted = 0
        for r in self.waiting:
            if not self._try_admit(r, now):
                break
            admitted += 1
        del self.waiting[:admitted]

    def _try_admit(self, r: SimRequest, now: float) -> bool:
        pools, page = self.pools, self.page
        e = pools.entry(r.program_id)
        pools.truncate(e, r.reuse // page)
        total = -(-(r.prompt + r.output) // page)
        pools.pin(e)
        room = pools.make_gpu_room(total - e.gpu, now)
        self._charge_writes(now)
        if not room:
            pools.unpin(e)
            return False
        gpu_hit, cpu_hit, disk_hit = e.gpu * page, e.cpu * page, e.disk * page
        if r.shared > gpu_hit + cpu_hit + disk_hit:  # the shared tools + system prefix is hot
            gpu_hit, cpu_hit, disk_hit = r.shared, 0, 0
        held = e.gpu + e.cpu + e.disk
        reload_pages, read_pages = pools.take_for_request(e, total)
        r.pages, r.held = total, held
        pools.touch(e, now)
        r.entry = e
        hit = gpu_hit + cpu_hit + disk_hit
        r.cached = min(r.prompt - 1, hit)  # at least one token is computed
        r.remaining = r.prompt - r.cached
        st = self.stats
        st.admitted += 1
        st.prompt_tokens += r.prompt
        st.reusable_tokens += r.reuse
        st.gpu_hit_tokens += gpu_hit
        st.cpu_hit_tokens += cpu_hit
        st.disk_hit_tokens += disk_hit
        st.recomputed_tokens += max(0, r.reuse - hit)
        if r.switched:
            st.switch_recomputed_tokens += max(0, r.reuse - hit)
        st.prefill_tokens += r.remaining
        ready = now
        if reload_pages and self.cost.preset.reload_on_engine:
            r.reload_s = self.cost.reload_time(reload_pages * page)  # in its first iteration
        elif reload_pages:
            start = max(now, self._link_free)
            self._link_free = start + self.cost.reload_time(reload_pages * page)
            ready = self._link_free
        if read_pages and self.disk is not None:
            start = max(now, self._disk_free)
            self._disk_free = start + self.cost.disk_read_time(read_pages * page, self.disk)
            ready = max(ready, self._disk_free)
        if ready > now:
            self.loading += 1
            self.loop.at(ready, PRIO_ENGINE, self._loaded, r)
        else:
            self.prefill.append(r)
            self.listener.kv_ready(r, now)
        return True

    def _charge_writes(self, now: float) -> None:
        """Put the pages the pools wrote to disk since the last charge on the disk link."""
        pools = self.pools
        n = pools.disk_write_backlog
        if n and self.disk is not None:
            pools.disk_write_backlog = 0
            tokens = n * self.page
            self.stats.disk_written_tokens += tokens
            self._disk_free = (max(now, self._disk_free)
                               + self.cost.disk_write_time(tokens, self.disk))

    def _loaded(self, r: SimRequest) -> None:
        self.loading -= 1
        if not r.aborted:
            self.prefill.append(r)
            self.listener.kv_ready(r, self.loop.now)
        self._kick()
