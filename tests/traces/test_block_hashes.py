"""Block hashes: kept compactly, and left unread where a run does not need them."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mori.traces import load_traces, read_traceset, write_traceset
from mori.traces.jsonl import _without_hashes
from mori.traces.model import (
    BlockHashes,
    GapKind,
    ProgramTrace,
    Step,
    SubagentSpawn,
    TraceSet,
    block_hashes,
)

INT64 = st.integers(-(2**63), 2**63 - 1)


@given(st.lists(INT64, max_size=50))
def test_block_hashes_behave_like_the_tuple_of_them(values: list[int]) -> None:
    h = block_hashes(values)
    assert isinstance(h, BlockHashes)
    assert h == tuple(values) and tuple(values) == h and h == values
    assert hash(h) == hash(tuple(values)) and len(h) == len(values)
    assert list(h) == values and list(h[1:3]) == values[1:3]
    assert pickle.loads(pickle.dumps(h)) == h
    assert h != tuple(values) + (0,)


def test_hashes_beyond_int64_stay_a_tuple() -> None:
    assert block_hashes([1, 2**64]) == (1, 2**64)
    assert isinstance(block_hashes([1, 2**64]), tuple)


def _hashed_set() -> TraceSet:
    sub = ProgramTrace("sub", (Step(10, 1, 0.0, GapKind.END, block_hashes=block_hashes([7])),),
                       block_size=8)
    steps = (Step(16, 2, 1.0, GapKind.SUBAGENT, block_hashes=block_hashes([1, 2]),
                  subagents=(SubagentSpawn(0.5, sub),)),
             Step(24, 2, 1.0, GapKind.END, reuse_tokens=16,
                  block_hashes=block_hashes([1, 2, 3])))
    return TraceSet("hashed", (ProgramTrace("p", steps, block_size=8),))


def _strip(p: ProgramTrace) -> ProgramTrace:
    return replace(p, block_size=None, steps=tuple(
        replace(s, block_hashes=None, subagents=tuple(replace(sp, program=_strip(sp.program))
                                                      for sp in s.subagents))
        for s in p.steps))


def test_reading_without_hashes_leaves_only_them_out(tmp_path: Path) -> None:
    ts = _hashed_set()
    f = tmp_path / "h.jsonl.gz"
    write_traceset(ts, f)
    kept = read_traceset(f)
    assert kept == ts
    assert isinstance(kept.programs[0].steps[1].block_hashes, BlockHashes)
    without = read_traceset(f, hashes=False)
    assert without.programs == tuple(_strip(p) for p in ts.programs)
    # what runs and statistics load: no hashes
    assert load_traces(f).programs == without.programs


@pytest.mark.parametrize(("line", "expected"), [
    (b'{"a":1,"block_hashes":[1,-2, 3],"b":2}', b'{"a":1,"b":2}'),
    (b'{"block_hashes":[1],"b":2}', b'{"b":2}'),
    (b'{"a":1,"block_hashes":[]}', b'{"a":1}'),
    (b'{"s":[{"block_hashes":[3],"d":1},{"d":2,"block_hashes":[4]}]}',
     b'{"s":[{"d":1},{"d":2}]}'),
    (b'{"block_hashes":[1,"x"]}', b'{"block_hashes":[1,"x"]}'),  # not integers: kept
])
def test_hash_arrays_are_cut_before_parsing(line: bytes, expected: bytes) -> None:
    assert _without_hashes(line) == expected
