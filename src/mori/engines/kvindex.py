"""Per-program KV-cache residency from decoded KV events (``mori.engines.kvevents``).

Attribution of blocks to programs (``KVBlockIndex``), by the first rule that applies:

1. ``session``: the block's ``session_id`` is a program id. With
   ``vllm_xargs={"kv_cache_report_mode": "full"}`` vLLM also re-reports the prefix-cache
   blocks a request *reuses*, with that request's session, so a block shared by several
   programs is held by each of them. Costs nothing in prefix sharing.
2. ``salt``: the first block's ``extra_keys`` hold a salt that maps to a program
   (``register_salt``). A per-program ``cache_salt`` makes every program's blocks distinct,
   so no prefix is shared across programs.
3. ``tokens``: the block's token chain (its tokens and all its ancestors') equals a prefix
   of a prompt the program sent (``learn_tokens``, fed from the engine's ``/tokenize``).
   The gateway cannot compute the engine's block hashes (seeded SHA-256 / xxhash over
   the token ids and extra keys), so the match runs on the token ids that ``BlockStored``
   carries: one chained key per block. Costs a ``/tokenize`` call per request.
4. A block that none of these claims inherits the programs of its parent block: it is the
   continuation (typically generated tokens) of their sequence. Inherited owners are
   provisional: a later direct claim (a session, a salt, a learnt prompt) replaces them.

A block stays attributed until the engine removes it; a program's residency per tier is the
sum of the tokens of the blocks it holds there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mori.engines.base import Residency
from mori.engines.kvevents import KVEventBatch, KVEventDecodeError, tier_of

BlockHash = int | bytes | str


def _hashable(h: Any) -> BlockHash:
    if isinstance(h, int | bytes | str):
        return h
    if isinstance(h, list | tuple):  # a (hash, group) pair or similar: make it hashable
        return repr(h)
    raise KVEventDecodeError(f"block hash of unexpected type {type(h).__name__}")


def _chain_key(parent_key: int | None, tokens: Sequence[int]) -> int:
    return hash((parent_key, tuple(tokens)))


def token_chain_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of the full blocks of a token sequence (what ``KVBlockIndex`` computes
    for stored blocks), so a prompt can be matched against the blocks of the engine."""
    keys: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Block:
    tokens: int
    parent: BlockHash | None
    owners: set[str] = field(default_factory=set)
    key: int | None = None
    inherited: bool = False  # owners taken from the parent, until a direct claim


@dataclass(slots=True)
class IndexStats:
    batches: int = 0
    events: int = 0
    unknown_events: int = 0
    decode_errors: int = 0
    seq_gaps: int = 0
    restarts: int = 0
    last_seq: int | None = None


class KVBlockIndex:
    """Which program holds which block in which tier, from decoded KV events (no I/O).

    ``attribution`` names the rules in force, any of ``session``, ``salt``, ``tokens``
    (see the module docstring); parent inheritance always applies.
    """

    def __init__(self, attribution: Iterable[str] = ("session", "salt", "tokens")) -> None:
        self.attribution = frozenset(attribution)
        unknown = self.attribution - {"session", "salt", "tokens"}
        if unknown:
            raise ValueError(f"unknown attribution rule(s) {sorted(unknown)}; "
                             "valid: session, salt, tokens")
        self.blocks: dict[str, dict[BlockHash, _Block]] = {"gpu": {}, "cpu": {}}
        self.block_size: int | None = None
        self.stats = IndexStats()
        self._salts: dict[str, str] = {}
        self._program_tokens: dict[str, list[int]] = {}
        self._key_programs: dict[int, set[str]] = {}
        self._program_keys: dict[str, set[int]] = {}
        self._key_blocks: dict[int, set[tuple[str, BlockHash]]] = {}

    # -- what the adapter tells the index ----------------------------------------------
    def register_salt(self, salt: str, program_id: str) -> None:
        self._salts[salt] = program_id

    def learn_tokens(self, program_id: str, token_ids: Sequence[int]) -> None:
        """The prompt ``program_id`` just sent, as the engine tokenizes it."""
        if "tokens" not in self.attribution:
            return
        self._program_tokens[program_id] = list(token_ids)
        if self.block_size:
            self._index_program(program_id)

    def forget_program(self, program_id: str) -> None:
        """Stop attributing new blocks to the program (it ended); blocks it holds stay
        attributed until the engine removes them."""
        self._program_tokens.pop(program_id, None)
        for key in self._program_keys.pop(program_id, set()):
            owners = self._key_programs.get(key)
            if owners is not None:
                owners.discard(program_id)
                if not owners:
                    del self._key_programs[key]

    def _index_program(self, pid: str) -> None:
        assert self.block_size
        keys = token_chain_keys(self._program_tokens[pid], self.block_size)
        mine = self._program_keys.setdefault(pid, set())
        for key in keys:
            if key in mine:
                continue
            mine.add(key)
            self._key_programs.setdefault(key, set()).add(pid)
            for tier, h in self._key_blocks.get(key, ()):
                blk = self.blocks[tier].get(h)
                if blk is not None:
                    if blk.inherited:
                        blk.owners.clear()
                        blk.inherited = False
                    blk.owners.add(pid)

    # -- events -----------------------------------------------------------------------
    def apply(self, batch: KVEventBatch) -> None:
        st = self.stats
        st.batches += 1
        if batch.seq is not None and batch.seq >= 0:
            if st.last_seq is not None:
                if batch.seq <= st.last_seq:
                    # sequence numbers restarted: the engine restarted with an empty cache
                    st.restarts += 1
                    self.clear()
                elif batch.seq != st.last_seq + 1:
                    st.seq_gaps += 1
            st.last_seq = batch.seq
        for ev in batch.events:
            st.events += 1
            if ev.kind == "BlockStored":
                self._stored(ev.fields)
            elif ev.kind == "BlockRemoved":
                self._removed(ev.fields)
            elif ev.kind == "AllBlocksCleared":
                self.clear()
            else:
                st.unknown_events += 1

    def clear(self) -> None:
        for tier in self.blocks.values():
            tier.clear()
        self._key_blocks.clear()

    def _stored(self, f: Mapping[str, Any]) -> None:
        tier = tier_of(f.get("medium"))
        if tier is None:
            return
        hashes = f.get("block_hashes") or []
        tokens = f.get("token_ids") or []
        size = f.get("block_size")
        if not isinstance(size, int) or size <= 0:
            size = len(tokens) // len(hashes) if hashes and tokens else (self.block_size or 0)
        if size and self.block_size != size:
            self.block_size = size
            for pid in list(self._program_tokens):
                self._index_program(pid)
        extra = f.get("extra_keys") or []
        session = f.get("session_id") if "session" in self.attribution else None
        pool = self.blocks[tier]
        parent: BlockHash | None = (_hashable(f["parent_block_hash"])
                                    if f.get("parent_block_hash") is not None else None)
        for i, raw_h in enumerate(hashes):
            h = _hashable(raw_h)
            chunk = tokens[i * size:(i + 1) * size] if size else []
            blk = pool.get(h)
            if blk is None:
                blk = _Block(tokens=len(chunk) or size, parent=parent)
                pool[h] = blk
            parent_blk = self._find(parent, tier) if parent is not None else None
            if "tokens" in self.attribution and chunk and blk.key is None:
                parent_key = parent_blk.key if parent_blk is not None else None
                if parent is None or parent_key is not None:
                    blk.key = _chain_key(parent_key, chunk)
                    self._key_blocks.setdefault(blk.key, set()).add((tier, h))
            claimed = self._claim(blk, session, extra[i] if i < len(extra) else None)
            if not claimed and not blk.owners and parent_blk is not None:
                blk.owners |= parent_blk.owners
                blk.inherited = bool(blk.owners)
            parent = h

    def _claim(self, blk: _Block, session: Any, extra: Any) -> bool:
        if blk.inherited and (session or extra or
                              (blk.key is not None and blk.key in self._key_programs)):
            blk.owners.clear()
            blk.inherited = False
        claimed = False
        if isinstance(session, str) and session:
            blk.owners.add(session)
            claimed = True
        if "salt" in self.attribution and isinstance(extra, list | tuple):
            for k in extra:
                pid = self._salts.get(k) if isinstance(k, str) else None
                if pid is not None:
                    blk.owners.add(pid)
                    claimed = True
        if blk.key is not None:
            pids = self._key_programs.get(blk.key)
            if pids:
                blk.owners |= pids
                claimed = True
        return claimed

    def _find(self, h: BlockHash, tier: str) -> _Block | None:
        blk = self.blocks[tier].get(h)
        if blk is None:  # a CPU copy's parent may be known only on the GPU, or back
            other = "cpu" if tier == "gpu" else "gpu"
            blk = self.blocks[other].get(h)
        return blk

    def _removed(self, f: Mapping[str, Any]) -> None:
        tier = tier_of(f.get("medium"))
        if tier is None:
            return
        pool = self.blocks[tier]
        for raw_h in f.get("block_hashes") or []:
            h = _hashable(raw_h)
            blk = pool.pop(h, None)
            if blk is not None and blk.key is not None:
                refs = self._key_blocks.get(blk.key)
                if refs is not None:
                    refs.discard((tier, h))
                    if not refs:
                        del self._key_blocks[blk.key]

    # -- queries ------------------------------------------------------------------------
    def residency(self) -> Residency:
        out: dict[str, dict[str, int]] = {"gpu": {}, "cpu": {}}
        for tier, pool in self.blocks.items():
            acc = out[tier]
            for blk in pool.values():
                for pid in blk.owners:
                    acc[pid] = acc.get(pid, 0) + blk.tokens
        return Residency(gpu_tokens=out["gpu"], cpu_tokens=out["cpu"])

    def tier_tokens(self) -> dict[str, int]:
        """Tokens cached per tier, attributed or not."""
        return {tier: sum(b.tokens for b in pool.values()) for tier, pool in self.blocks.items()}

    def unattributed_tokens(self) -> dict[str, int]:
        return {tier: sum(b.tokens for b in pool.values() if not b.owners)
                for tier, pool in self.blocks.items()}
