"""``LineBuffer``: whole lines out of a stream cut anywhere, the same whatever the cuts;
what is held stays within the cap; a stream cut at line ends passes without a copy; the
work is linear in the bytes (a long line in tiny pieces is given back as those pieces,
never joined to each new one)."""

from __future__ import annotations

import random

import pytest

from mori.protocol.sse import LineBuffer, LineTooLong

STREAM = (b'data: {"a": 1}\n\nevent: x\ndata: {"b": "' + b"y" * 300 + b'"}\n\n'
          b": comment\r\n\r\ndata: [DONE]\n\n")


def feed_all(buf: LineBuffer, data: bytes, cuts: list[int]) -> bytes:
    out: list[bytes] = []
    last = 0
    for c in [*sorted(cuts), len(data)]:
        out += buf.feed(data[last:c])
        last = c
    return b"".join(out)


@pytest.mark.parametrize("seed", range(20))
def test_any_cuts_give_the_same_whole_lines(seed: int) -> None:
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(STREAM)), rng.randint(1, 40))
    buf = LineBuffer(1024)
    assert feed_all(buf, STREAM + b"data: {\"par", cuts) == STREAM
    assert buf.held == len(b"data: {\"par")
    assert buf.rest() == b"data: {\"par" and buf.held == 0


def test_a_chunk_of_whole_lines_passes_without_a_copy() -> None:
    buf = LineBuffer(1024)
    chunk = b"data: 1\n\n"
    got = buf.feed(chunk)
    assert len(got) == 1 and got[0] is chunk
    assert buf.feed(b"") == [] and buf.held == 0


@pytest.mark.parametrize("where", ["held", "first", "between", "tail"])
def test_a_line_over_the_cap_raises(where: str) -> None:
    cap = 64
    long = b"x" * (cap + 1)
    buf = LineBuffer(cap)
    chunks = {"held": [long[:40], long[40:]],  # no line end yet: held past the cap
              "first": [long[:40], long[40:] + b"\nok\n"],  # its end comes with the rest
              "between": [b"ok\n" + long + b"\nok\n"],  # within one chunk
              "tail": [b"ok\n" + long]}[where]
    with pytest.raises(LineTooLong) as e:
        for c in chunks:
            buf.feed(c)
    assert e.value.limit == cap and e.value.size > cap


def test_a_line_at_the_cap_passes() -> None:
    cap = 64
    line = b"x" * cap + b"\n"
    assert LineBuffer(cap).feed(line) == [line]
    buf = LineBuffer(cap)
    assert buf.feed(line[:10]) == [] and buf.feed(line[10:]) == [line[:10], line[10:]]


def test_a_long_line_in_tiny_pieces_comes_back_as_its_pieces() -> None:
    """Linear work: each piece is kept, not joined to what came before (that was the
    quadratic cost); the held size is counted, not measured by joining."""
    buf = LineBuffer(1 << 20)
    pieces = [b"y" * 16] * 4096
    for p in pieces:
        assert buf.feed(p) == []
    assert buf.held == 16 * 4096
    out = buf.feed(b"\nnext")
    assert len(out) == len(pieces) + 1 and all(a is b for a, b in zip(out[:-1], pieces, strict=True))
    assert b"".join(out) == b"y" * (16 * 4096) + b"\n" and buf.held == 4


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LineBuffer(0)
