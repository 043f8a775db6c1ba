"""MORI's CPU tier for vLLM's ``OffloadingConnector`` (0.32 to 0.34): typed eviction of host
chunks.

vLLM's ``OffloadingConnector`` (``--kv-transfer-config '{"kv_connector":
"OffloadingConnector", ...}'``) copies KV blocks evicted from the GPU prefix cache to a host
tier and loads them back on a prefix hit. Its ``CPUOffloadingManager``
(``v1/kv_offload/cpu/manager.py``) keeps the host chunks and delegates the choice of
which chunk to evict to a ``CachePolicy`` resolved by name, out of tree included
(``eviction_policy`` + ``cache_policy_module_path`` in ``kv_connector_extra_config``;
``v1/kv_offload/cpu/policies/factory.py:39-82``). Paths below are relative to the
installed ``vllm`` package, lines as of 0.32 unless a release is named.

This module provides :class:`MoriCachePolicy`, that ``CachePolicy`` (the CPU build's copy
worker and host spec are in ``host_tier``; ``connector_config.kv_transfer_config`` is the
flag that loads them). It evicts host chunks by class, in the CPU tier's order of
``mori.core.eviction_order`` (read from there; that module says why each class goes when
it goes), least recently used first within a class, recency kept exactly as the installed vLLM's ``LRUCachePolicy`` keeps it
(``v1/kv_offload/cpu/policies/lru.py``; see :class:`MoriCachePolicy` for what changed in
0.33). A chunk's class is the most protective (``idle`` >
``busy`` > ``cold`` > ``inactive``) label among the programs whose requests used it; a chunk no known
program used is ``busy``, as is a program without a label. So an unbound policy, or one
whose gateway is silent, evicts exactly as vLLM's LRU does. A chunk whose every program was
dropped (:meth:`MoriCachePolicy.drop`) is ``inactive`` until a request uses it again. In a
tier no larger than the GPU pool (:meth:`MoriCachePolicy.set_mirror_only`), an ``inactive``
program's chunks are kept by recency with the ``busy`` ones instead, renewed when the
program turns ``inactive``: there they are the only copies that can save a recompute.

How the policy learns a chunk's program and that program's label:

- the program is ``kv_transfer_params["mori_program"]`` of the request context
  (``ReqContext.kv_transfer_params`` is the request's ``kv_transfer_params``:
  ``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:548-560``), read once
  per request and kept in the context's scratch state;
- the label is ``label(program)``, a callable bound with :meth:`MoriCachePolicy.bind`
  (the MORI scheduler's ``LabelTable.label``). When labels change, the binder calls
  :meth:`MoriCachePolicy.relabel` (or :meth:`MoriCachePolicy.relabel_all`) so that the
  affected chunks move to their new class.

The MORI scheduler (``scheduler.py``) binds every policy built in its process
(:func:`live_policies`) to its label table, relabels on each label message, and copies
``Request.session_id`` into ``kv_transfer_params`` when a request arrives.

This module imports vLLM (and torch); it is imported inside vLLM's processes only.
"""

from __future__ import annotations

import heapq
import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import vllm
from vllm.v1.kv_offload.base import (
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from mori.core.eviction_order import UNKEPT, eviction_order, label_ranks, most_protected
from mori.core.types import Tier
from mori.plugin_channel import kv_hints
from mori.plugin_channel.labels import DEFAULT_LABEL, MAX_PROGRAMS_PER_BLOCK

from . import compat
from .connector_config import PROGRAM_KEY

logger = logging.getLogger("vllm.mori_plugin.cpu_tier")

# Protection of a host chunk by label (higher is evicted later): the CPU tier's order of
# mori.core.eviction_order
CPU_PROTECTION = label_ranks(Tier.CPU)
EVICT_ORDER = tuple(label.value for label in eviction_order(Tier.CPU))  # first .. last
# a chunk used by more than MAX_PROGRAMS_PER_BLOCK programs: the most protected class
WIDE_CLASS = most_protected(Tier.CPU).value
MIRROR_INACTIVE_CLASS = "busy"  # an inactive program's chunk in a mirror-only tier
COMPACT_MIN = 64  # heaps are rebuilt when they hold > max(this, 4 x evictable) entries

# The policies built in this process. vLLM builds the policy deep inside the scheduler's
# construction and keeps it at scheduler.connector.connector_scheduler.manager._policy;
# the registry lets the scheduler find it without walking those internals.
_POLICIES: weakref.WeakSet[MoriCachePolicy] = weakref.WeakSet()

Rank = tuple[int, int]  # (recency, -position within a request in progress); lower goes first


def live_policies() -> list[MoriCachePolicy]:
    """The :class:`MoriCachePolicy` instances alive in this process."""
    return list(_POLICIES)


def program_of(req_context: ReqContext) -> str | None:
    """A request context's program (a non-empty str): ``kv_transfer_params["mori_program"]``
    (the MORI scheduler's copy of ``Request.session_id``), else the program a MORI action
    of ``ReqContext.kv_hints`` names (``mori.plugin_channel.kv_hints``: what the gateway
    sends an engine that takes ``kv_hints`` in a request's body, without the scheduler)."""
    params = req_context.kv_transfer_params
    if isinstance(params, dict):
        value = params.get(PROGRAM_KEY)
        if isinstance(value, str) and value:
            return value
    return kv_hints.program_of(getattr(req_context, "kv_hints", None))


@dataclass(slots=True)
class _Program:
    """Per-request scratch kept in ``ReqContext`` (by type): the request's program."""

    name: str | None


@dataclass(slots=True)
class _RequestRank:
    """Per-request scratch kept in ``ReqContext``: the one recency rank that a request in
    progress gives every chunk it stores or reaches (vLLM 0.33's LRU does the same)."""

    owner: object
    generation: int
    rank: int


def _unbound_label(_program: str) -> str:
    return DEFAULT_LABEL


class TierLabels:
    """Programs' labels as one tier reads them (a part of :class:`MoriCachePolicy` and of
    ``disk_tier.MoriDiskTier``): ``label(program)`` once :meth:`bind` gave it (the MORI
    scheduler's ``LabelTable.label``), the default label before. A label outside the
    tier's ``known`` ones, or an error in the lookup (logged once), counts as the
    default."""

    def __init__(self, known: Iterable[str], tier: str) -> None:
        self.known = frozenset(known)
        self.tier = tier
        self.lookup: Callable[[str], str] = _unbound_label
        self.bound = False
        self._failed = False

    def bind(self, label: Callable[[str], str]) -> None:
        self.lookup = label
        self.bound = True
        self._failed = False

    def __call__(self, program: str) -> str:
        try:
            label = self.lookup(program)
        except Exception:
            if not self._failed:
                self._failed = True
                logger.exception("MORI %s: the label lookup failed; such chunks count as "
                                 "%s", self.tier, DEFAULT_LABEL)
            return DEFAULT_LABEL
        return label if label in self.known else DEFAULT_LABEL


class MoriCachePolicy(CachePolicy):  # type: ignore[misc]
    """vLLM's ``CachePolicy`` (``v1/kv_offload/cpu/policies/base.py:48-142``) evicting by
    MORI's labels.

    Contract (the base class's, which ``CPUOffloadingManager`` relies on): ``get`` /
    ``insert`` / ``remove`` keep the chunk table; ``mark_evictable`` /
    ``mark_non_evictable`` follow a chunk's ``ref_cnt`` to and from 0 (only chunks at 0 —
    stored and not being loaded — are eviction candidates); ``evict(n, protected)`` evicts
    exactly ``n`` evictable chunks not in ``protected``, or changes nothing and returns
    ``None``; ``clear`` forgets everything.

    Recency mirrors the installed ``LRUCachePolicy`` (``v1/kv_offload/cpu/policies/lru.py``):
    a chunk's rank is set at ``insert`` and renewed by ``touch`` and ``on_request_finished``
    (keys applied tail first, so a request's prefix head is the most recent); evictable
    chunks sit in lazily invalidated min-heaps by rank, one heap per class here instead of
    one in all. Ranks are pairs ``(recency, -position)``. vLLM 0.33 passes ``insert`` the
    storing request's context, and its LRU gives the chunks of a request in progress one
    shared recency, ordered by their token position (``ReqContext.get_offload_key_position``),
    tail first; its new hook ``on_request_access`` raises a chunk the request reaches to that
    rank. This policy does the same whenever ``insert`` gets a context with the key's
    position; under 0.32, which passes none, every insert takes a fresh recency, as 0.32's
    LRU does. One code path serves both: what differs is what vLLM hands in.

    Ownership: a chunk belongs to the programs of the requests that stored, reused or
    touched it — recorded at ``insert`` (from its context under 0.33; under 0.32 from the
    ``on_store_miss`` that came before), at ``on_request_access`` (0.33), at ``touch`` and
    at ``on_request_finished``. More than ``MAX_PROGRAMS_PER_BLOCK`` programs
    make it *wide*: kept as ``idle`` (once bound). A label the callable returns that is not one of
    ``CPU_PROTECTION``, or an error in it, counts as ``busy``.
    """

    def __init__(self, cache_capacity: int) -> None:
        compat.check(vllm.__version__, compat.hook_problems(
            CachePolicy, type(self), compat.public_methods(CachePolicy)))
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._rank: dict[OffloadKey, Rank] = {}
        self._next_rank = 0
        self._generation = 0  # a request's shared rank is void after clear()
        self._evictable: set[OffloadKey] = set()
        self._cls: dict[OffloadKey, str] = {}  # the heap holding a key's live entry
        self._heaps: dict[str, list[tuple[Rank, OffloadKey]]] = {c: [] for c in EVICT_ORDER}
        self._owners: dict[OffloadKey, set[str]] = {}
        self._keys_of: dict[str, set[OffloadKey]] = {}
        self._wide: set[OffloadKey] = set()
        self._dropped: set[OffloadKey] = set()  # every owner dropped: inactive
        self._pending_owner: dict[OffloadKey, str] = {}  # on_store_miss -> insert
        self.labels = TierLabels(CPU_PROTECTION, "CPU tier")
        self.evicted_by_class: dict[str, int] = dict.fromkeys(EVICT_ORDER, 0)
        self.mirror_only = False
        self._turned_inactive: set[str] = set()  # renewed once (mirror_only)
        _POLICIES.add(self)

    # -- binding (by the MORI scheduler, in the engine-core process) ---------------------
    def bind(self, label: Callable[[str], str]) -> None:
        """Read programs' labels from ``label(program)`` from now on; re-files every
        evictable chunk."""
        self.labels.bind(label)
        self.relabel_all()

    @property
    def bound(self) -> bool:
        return self.labels.bound

    @property
    def _label(self) -> Callable[[str], str]:
        return self.labels.lookup

    def set_mirror_only(self, mirror_only: bool) -> None:
        """Whether the tier is no larger than the GPU pool. vLLM's host tier is written
        through, so such a tier holds nothing beyond a mirror of the GPU and the gateway
        parks no program on it (``mori.engines.vllm.beyond_mirror``): every demotion is
        to no tier. The chunks of a program demoted so (label ``inactive``) are then the
        ones whose host copy can still save a recompute, while a busy program's copy
        duplicates its GPU blocks. So in such a tier an ``inactive`` program's chunks are
        evicted by recency with the busy ones (vLLM's LRU) rather than first, and they
        are renewed when the program turns ``inactive``, as if used then: its return
        finds them unless a tier's worth of newer chunks came since. A chunk whose every
        program was dropped (:meth:`drop`) still goes first. (A program that ended is
        labelled ``inactive`` too; its chunks are renewed as well and age out by
        recency.)"""
        self.mirror_only = mirror_only
        self._turned_inactive.clear()
        self.relabel_all()

    def relabel(self, programs: Iterable[str]) -> int:
        """These programs' labels may have changed: move their evictable chunks to their
        new class (keeping their recency; in a ``mirror_only`` tier, renewing that of a
        program that turned ``inactive``). Returns how many chunks moved."""
        programs = list(programs)
        if self.mirror_only:
            self._renew_turned_inactive(programs)
        keys: set[OffloadKey] = set()
        for program in programs:
            keys |= self._keys_of.get(program, set())
        return self._refile_all(keys)

    def _renew_turned_inactive(self, programs: Iterable[str]) -> None:
        """Give the chunks of each program that turned ``inactive`` fresh recency, in
        their present order (:meth:`set_mirror_only`)."""
        for program in programs:
            if self._label_of(program) != UNKEPT.value:
                self._turned_inactive.discard(program)
                continue
            if program in self._turned_inactive:
                continue
            self._turned_inactive.add(program)
            keys = self._keys_of.get(program)
            if keys:
                self._update_recency(sorted(keys, key=lambda k: self._rank.get(k, (0, 0))))
        if len(self._turned_inactive) > max(COMPACT_MIN, 2 * len(self._keys_of)):
            self._turned_inactive &= self._keys_of.keys()

    def drop(self, program: str) -> int:
        """The gateway dropped ``program``: its chunks lose it as an owner, and those it
        alone owned become ``inactive`` (evicted first) until a request uses them again.
        Returns how many chunks became ``inactive``."""
        orphaned = 0
        self._turned_inactive.discard(program)
        for key in self._keys_of.pop(program, set()):
            owners = self._owners.get(key)
            if owners is None:
                continue
            owners.discard(program)
            if not owners:
                del self._owners[key]
                self._dropped.add(key)
                orphaned += 1
            self._refile(key)
        self._maybe_compact()
        return orphaned

    def relabel_all(self) -> int:
        """Any label may have changed (``replace``, ``clear``): re-file every evictable
        chunk (the others are filed when they become evictable)."""
        return self._refile_all(list(self._evictable))

    # -- reading --------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def chunks_held(self) -> dict[str, int]:
        """program -> how many chunks of the tier it owns. Safe to call from another
        thread while the tier changes (copies taken in single C-level calls, taken again
        if a table changed meanwhile)."""
        for _ in range(5):
            try:
                return {p: len(keys) for p, keys in list(self._keys_of.items()) if keys}
            except RuntimeError:
                continue
        return {}

    def programs_of(self, key: OffloadKey) -> frozenset[str]:
        return frozenset(self._owners.get(key, ()))

    def class_of(self, key: OffloadKey) -> str:
        """The chunk's class now: the most protective label of its programs."""
        if key in self._wide:  # unbound, every label is the default: so is this one
            return WIDE_CLASS if self.bound else DEFAULT_LABEL
        owners = self._owners.get(key)
        if not owners:
            return EVICT_ORDER[0] if key in self._dropped else DEFAULT_LABEL
        best = EVICT_ORDER[0]
        for program in owners:
            label = self._label_of(program)
            if CPU_PROTECTION[label] > CPU_PROTECTION[best]:
                best = label
                if best == EVICT_ORDER[-1]:
                    break
        if best == EVICT_ORDER[0] and self.mirror_only:
            return MIRROR_INACTIVE_CLASS
        return best

    def sizes(self) -> dict[str, int]:
        """Evictable chunks per class (for logs)."""
        out = dict.fromkeys(EVICT_ORDER, 0)
        for key in self._evictable:
            out[self._cls.get(key, DEFAULT_LABEL)] += 1
        return out

    # -- attribution ----------------------------------------------------------------------
    def _label_of(self, program: str) -> str:
        return self.labels(program)

    def _program(self, req_context: ReqContext) -> str | None:
        state = req_context.get_state(_Program)
        if state is None:
            state = _Program(program_of(req_context))
            req_context.set_state(state)
        name: str | None = state.name
        return name

    def _own(self, key: OffloadKey, program: str | None) -> None:
        if program is None or key not in self.chunks or key in self._wide:
            return
        self._dropped.discard(key)
        owners = self._owners.setdefault(key, set())
        if program in owners:
            return
        if len(owners) >= MAX_PROGRAMS_PER_BLOCK:
            self._wide.add(key)
        else:
            owners.add(program)
            self._keys_of.setdefault(program, set()).add(key)
        self._refile(key)

    def _disown(self, key: OffloadKey) -> None:
        self._wide.discard(key)
        self._dropped.discard(key)
        for program in self._owners.pop(key, ()):
            keys = self._keys_of.get(program)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._keys_of[program]

    def _forget(self, key: OffloadKey) -> None:
        self._rank.pop(key, None)
        self._evictable.discard(key)
        self._cls.pop(key, None)
        self._disown(key)

    # -- heaps (lazy invalidation, as LRUCachePolicy's) ---------------------------------
    def _push(self, key: OffloadKey) -> None:
        cls = self.class_of(key)
        self._cls[key] = cls
        heapq.heappush(self._heaps[cls], (self._rank[key], key))

    def _refile(self, key: OffloadKey) -> bool:
        if key in self._evictable and self.class_of(key) != self._cls.get(key):
            self._push(key)
            return True
        return False

    def _refile_all(self, keys: Iterable[OffloadKey]) -> int:
        moved = sum(1 for key in keys if self._refile(key))
        self._maybe_compact()
        return moved

    def _live(self, cls: str, entry: tuple[Rank, OffloadKey]) -> bool:
        rank, key = entry
        return (key in self._evictable and self._cls.get(key) == cls
                and self._rank.get(key) == rank)

    def _maybe_compact(self) -> None:
        if sum(map(len, self._heaps.values())) <= max(COMPACT_MIN, 4 * len(self._evictable)):
            return
        heaps: dict[str, list[tuple[Rank, OffloadKey]]] = {c: [] for c in EVICT_ORDER}
        for key in self._evictable:
            heaps[self._cls[key]].append((self._rank[key], key))
        for heap in heaps.values():
            heapq.heapify(heap)
        self._heaps = heaps

    def _fresh_rank(self) -> Rank:
        self._next_rank += 1
        return (self._next_rank, 0)

    # vllm-release: 0.33, 0.34
    def _request_rank(self, req_context: ReqContext) -> int:
        state = req_context.get_state(_RequestRank)
        if state is None or state.owner is not self or state.generation != self._generation:
            self._next_rank += 1
            state = _RequestRank(self, self._generation, self._next_rank)
            req_context.set_state(state)
        rank: int = state.rank
        return rank

    def _update_recency(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self.chunks:
                self._rank[key] = self._fresh_rank()
                if key in self._evictable:
                    self._push(key)
        self._maybe_compact()

    # -- CachePolicy ----------------------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus,
               req_context: ReqContext | None = None) -> None:
        # vLLM 0.33 passes the storing request's context; 0.32 does not
        self.chunks[key] = chunk
        position = None if req_context is None else req_context.get_offload_key_position(key)
        if position is None or req_context is None:
            self._rank[key] = self._fresh_rank()
        else:
            self._rank[key] = (self._request_rank(req_context), -position)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            self._push(key)
        # vllm-release: 0.32
        owner = self._pending_owner.pop(key, None)
        # vllm-release: 0.33, 0.34
        if req_context is not None:
            owner = self._program(req_context)
        self._own(key, owner)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._forget(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        program = self._program(req_context)
        for key in keys:
            self._own(key, program)
        self._update_recency(reversed(keys))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # vLLM 0.33: the request's first access to these keys (a load or a store offer).
        # The reached chunks become the program's, and rise to the request's shared rank,
        # ordered by position, as 0.33's LRU orders them.
        program = self._program(req_context)
        request_rank = self._request_rank(req_context)
        moved = False
        for key in keys:
            position = req_context.get_offload_key_position(key)
            if position is None or key not in self.chunks:
                continue
            self._own(key, program)
            rank = (request_rank, -position)
            if self._rank[key] >= rank:
                continue
            self._rank[key] = rank
            if key in self._evictable:
                self._push(key)
                moved = True
        if moved:
            self._maybe_compact()

    # vllm-release: 0.32
    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Not a use (CachePolicy's default would touch). Under 0.32, whose insert gets no
        # context, remember whose chunks these will be, so that they are classed from
        # their insertion on.
        program = self._program(req_context)
        if program is None:
            return
        if len(self._pending_owner) > max(COMPACT_MIN, 4 * self.cache_capacity):
            self._pending_owner.clear()  # misses of requests that never finished
        for key in keys:
            self._pending_owner[key] = program

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]],
                            insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey],
                            req_context: ReqContext) -> None:
        del insertion_only_keys, reused_keys
        program = self._program(req_context)
        ordered = order_request_keys(key_groups, req_context)
        for key in ordered:
            self._pending_owner.pop(key, None)
            self._own(key, program)
        self._update_recency(reversed(ordered))

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key)
        self._maybe_compact()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    def clear(self) -> None:
        self.chunks.clear()
        self._rank.clear()
        self._next_rank = 0
        self._generation += 1
        self._evictable.clear()
        self._cls.clear()
        for heap in self._heaps.values():
            heap.clear()
        self._owners.clear()
        self._keys_of.clear()
        self._wide.clear()
        self._dropped.clear()
        self._pending_owner.clear()
        self._turned_inactive.clear()

    def evict(self, n: int, protected: set[OffloadKey]
              ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        picked: list[tuple[str, tuple[Rank, OffloadKey]]] = []
        deferred: list[tuple[str, tuple[Rank, OffloadKey]]] = []
        seen: set[OffloadKey] = set()
        for cls in EVICT_ORDER:
            heap = self._heaps[cls]
            while heap and len(picked) < n:
                entry = heapq.heappop(heap)
                key = entry[1]
                if not self._live(cls, entry) or key in seen:
                    continue  # stale, or a duplicate of a picked entry
                if key in protected:
                    deferred.append((cls, entry))
                    continue
                seen.add(key)
                picked.append((cls, entry))
            if len(picked) >= n:
                break
        for cls, entry in deferred:
            heapq.heappush(self._heaps[cls], entry)
        if len(picked) < n:  # atomic: put the live entries back, change nothing
            for cls, entry in picked:
                heapq.heappush(self._heaps[cls], entry)
            return None
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for cls, (_, key) in picked:
            chunk = self.chunks.pop(key)
            assert chunk.ref_cnt == 0
            self._forget(key)
            self.evicted_by_class[cls] += 1
            out.append((key, chunk))
        self._maybe_compact()
        return out
