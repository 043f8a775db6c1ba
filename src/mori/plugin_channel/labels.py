"""Which label each program and each KV block has: the side tables a MORI plug-in keeps
inside its engine.

The SGLang plug-in (``mori.sglang_plugin``) reads the program labels only (its tree nodes
carry their programs). The vLLM plug-in's scheduler (``mori.vllm_plugin``) reads the
block labels too: vLLM's ``KVCacheBlock`` has ``__slots__``, so nothing can be attached to
a block; these tables hold what MORI knows instead:

- program -> label, as the gateway sent it (``busy``, ``idle``, ``cold``, ``inactive``:
  on the GPU, parked on the CPU tier, parked on the disk tier, on no tier); bounded
  (``max_programs``, the least recently set label is forgotten first);
- block id -> the programs whose requests used the block, learned from running requests
  (``Request.session_id`` is the program id; the scheduler reads each running request's
  blocks from the KV cache manager) and forgotten when the pool hands the block out for
  new content. A block used by more than ``max_programs_per_block`` programs is marked
  *widely shared* and kept busy (which one of them runs next is anyone's guess).

A block's label is the most protective label of its programs on the GPU (the highest
rank in the GPU's order of ``mori.core.eviction_order``): a prefix that a busy program
shares with an inactive one is still needed.

The default label — of a program the gateway has not labelled, and of a block no known
program used (requests without ``session_id``) — is ``busy``, the most protective one:
labels only ever *demote* blocks below the unlabelled ones. So a vLLM engine whose gateway
is silent, restarting or not there at all evicts exactly as plain vLLM does (LRU), and a
client that talks to the engine directly is never penalised for not being a MORI program;
only what MORI positively knows to be idle or inactive goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from mori.core.eviction_order import UNKEPT, label_ranks, most_protected
from mori.core.types import Tier

# label -> protection of a GPU block (higher is evicted later): the GPU's eviction order
PROTECTION = label_ranks(Tier.GPU)
GPU_KEEPS_LONGEST = most_protected(Tier.GPU).value
DEFAULT_LABEL = "busy"
MAX_PROGRAMS = 65536
MAX_PROGRAMS_PER_BLOCK = 64
SNAPSHOT_TRIES = 5


class LabelTable:
    """program -> label, block -> programs, and the label of a block."""

    def __init__(self, max_programs: int = MAX_PROGRAMS,
                 max_programs_per_block: int = MAX_PROGRAMS_PER_BLOCK,
                 default: str = DEFAULT_LABEL) -> None:
        if default not in PROTECTION:
            raise ValueError(f"default label {default!r} is not one of {sorted(PROTECTION)}")
        if max_programs < 1 or max_programs_per_block < 1:
            raise ValueError("max_programs and max_programs_per_block must be >= 1")
        self.default = default
        self.max_programs = max_programs
        self.max_programs_per_block = max_programs_per_block
        self._labels: OrderedDict[str, str] = OrderedDict()
        self._block_programs: dict[int, set[str]] = {}
        self._program_blocks: dict[str, set[int]] = {}
        self._wide: set[int] = set()  # blocks used by too many programs: kept busy

    # -- reading ------------------------------------------------------------------------
    def __len__(self) -> int:
        """How many programs have a label."""
        return len(self._labels)

    def label(self, program: str) -> str:
        return self._labels.get(program, self.default)

    def labels(self) -> dict[str, str]:
        return dict(self._labels)

    def programs_of(self, block_id: int) -> frozenset[str]:
        return frozenset(self._block_programs.get(block_id, ()))

    def blocks_of(self, program: str) -> frozenset[int]:
        return frozenset(self._program_blocks.get(program, ()))

    def held(self, cached: Callable[[int], bool]) -> dict[str, int]:
        """program -> how many of its blocks ``cached(block_id)`` says still hold content,
        for the programs holding at least one.

        Safe to call from another thread while the scheduler's thread changes the table
        (the label server answers ``residency`` this way): it reads copies, taken in
        single C-level calls, and takes them again if a table changed while it read."""
        for _ in range(SNAPSHOT_TRIES):
            try:
                owned = [(p, list(blocks)) for p, blocks in list(self._program_blocks.items())]
                break
            except RuntimeError:  # changed size while copied: take it again
                continue
        else:
            return {}
        out: dict[str, int] = {}
        for program, blocks in owned:
            n = sum(1 for b in blocks if cached(b))
            if n:
                out[program] = n
        return out

    def labelled(self, label: str) -> list[str]:
        """The programs with this label (safe from another thread, as ``held``)."""
        for _ in range(SNAPSHOT_TRIES):
            try:
                return [p for p, lab in list(self._labels.items()) if lab == label]
            except RuntimeError:
                continue
        return []

    def label_of_block(self, block_id: int) -> str:
        """The most protective label among the block's programs (the default without)."""
        if block_id in self._wide:
            return "busy"
        programs = self._block_programs.get(block_id)
        if not programs:
            return self.default
        best = UNKEPT.value
        for p in programs:
            label = self._labels.get(p, self.default)
            if PROTECTION[label] > PROTECTION[best]:
                best = label
                if label == GPU_KEEPS_LONGEST:
                    break
        return best

    def label_of(self, block: Any) -> str:
        """``label_of_block`` for a vLLM ``KVCacheBlock`` (the typed queue's callback)."""
        return self.label_of_block(block.block_id)

    # -- learning which program used which block ----------------------------------------
    def learn(self, program: str, block_ids: Iterable[int]) -> None:
        """``program``'s request holds these blocks."""
        mine = self._program_blocks.get(program)
        for bid in block_ids:
            if bid in self._wide:
                continue
            users = self._block_programs.setdefault(bid, set())
            if program in users:
                continue
            if len(users) >= self.max_programs_per_block:
                self._wide.add(bid)
                continue
            users.add(program)
            if mine is None:
                mine = self._program_blocks[program] = set()
            mine.add(bid)

    def forget_block(self, block_id: int) -> None:
        """The block now holds other content (the pool handed it out again)."""
        self._wide.discard(block_id)
        users = self._block_programs.pop(block_id, None)
        if not users:
            return
        for p in users:
            blocks = self._program_blocks.get(p)
            if blocks is not None:
                blocks.discard(block_id)
                if not blocks:
                    del self._program_blocks[p]

    def forget_all_blocks(self) -> None:
        self._block_programs.clear()
        self._program_blocks.clear()
        self._wide.clear()

    # -- the label channel's operations (each returns the block ids whose label may have
    # changed: the caller reclassifies those that are free) ------------------------------
    def set_labels(self, labels: Mapping[str, str]) -> set[int]:
        affected: set[int] = set()
        for program, label in labels.items():
            if label not in PROTECTION:
                raise ValueError(f"label {label!r} of {program!r} is not one of "
                                 f"{sorted(PROTECTION)}")
            if self._labels.get(program, self.default) != label:
                affected |= self._program_blocks.get(program, set())
            self._labels[program] = label
            self._labels.move_to_end(program)
        while len(self._labels) > self.max_programs:
            program, label = self._labels.popitem(last=False)
            if label != self.default:
                affected |= self._program_blocks.get(program, set())
        return affected

    def replace(self, labels: Mapping[str, str]) -> set[int]:
        old = self._labels
        self._labels = OrderedDict()
        try:
            self.set_labels(labels)
        except ValueError:
            self._labels = old
            raise
        affected: set[int] = set()
        for program in old.keys() | self._labels.keys():
            if old.get(program, self.default) != self._labels.get(program, self.default):
                affected |= self._program_blocks.get(program, set())
        return affected

    def clear(self) -> set[int]:
        return self.replace({})

    def drop(self, program: str, blocks: Sequence[Any]) -> tuple[set[int], set[int]]:
        """Forget ``program``'s label and its blocks.

        Returns ``(evict, affected)``: ``evict``, the block ids to evict from the prefix
        cache now: cached (with a hash), held by no running request (``ref_cnt == 0``)
        and used by no other program (a prefix shared with another program stays, with
        that program's label); ``affected``, every block id whose label may have changed
        (``evict`` included). ``blocks[block_id]`` is the pool's block.
        """
        self._labels.pop(program, None)
        evict: set[int] = set()
        affected: set[int] = set()
        for bid in self._program_blocks.pop(program, set()):
            affected.add(bid)
            users = self._block_programs.get(bid)
            if users is not None:
                users.discard(program)
                if users:
                    continue
                del self._block_programs[bid]
            if bid in self._wide:
                continue
            block = blocks[bid]
            if block.ref_cnt == 0 and block.block_hash is not None:
                evict.add(bid)
        return evict, affected
