"""Canonical trace files cut while being written: a torn last line is skipped with a
note, every whole line before it read; damage anywhere else still raises."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.traces import GapKind, ProgramTrace, Step, TraceError, read_traceset
from mori.traces.jsonl import (
    TornLine,
    complete_length,
    encode_header,
    encode_program,
    iter_programs,
    write_programs,
)


def _program(name: str, steps: int = 3) -> ProgramTrace:
    body = [Step(100 * (i + 1), 5, 1.25, GapKind.TOOL, 90 * i, call_s=0.5,
                 tool_names=("Read",)) for i in range(steps - 1)]
    return ProgramTrace(name, (*body, Step(100 * steps, 5, 0.0, GapKind.END, 90)), source="x")


PROGRAMS = [_program("k0/a"), _program("anon-1 \"q\"\u00e9", 2), _program("k0/b", 5)]


def _members(programs: list[ProgramTrace]) -> list[bytes]:
    """A file written a line a gzip member, as the recorder writes it: the members."""
    lines = [encode_header("rec"), *(encode_program(p) for p in programs)]
    return [gzip.compress(line, mtime=0) for line in lines]


def test_line_members_read_as_one_file(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(b"".join(_members(PROGRAMS)))
    notes: list[TornLine] = []
    assert read_traceset(path, on_torn=notes.append).programs == tuple(PROGRAMS)
    assert notes == []
    assert gzip.decompress(path.read_bytes()).count(b"\n") == 4  # plain gzip reads it too
    assert complete_length(path) == path.stat().st_size


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_gzip_cut_in_last_member(tmp_path_factory: pytest.TempPathFactory,
                                 data: st.DataObject) -> None:
    members = _members(PROGRAMS)
    whole = b"".join(members[:-1])
    cut = data.draw(st.integers(1, len(members[-1]) - 1), label="bytes of the last member")
    path = tmp_path_factory.mktemp("cut") / "r.jsonl.gz"
    path.write_bytes(whole + members[-1][:cut])
    notes: list[TornLine] = []
    assert tuple(iter_programs(path, on_torn=notes.append)) == tuple(PROGRAMS[:-1])
    assert len(notes) == 1
    torn = notes[0]
    assert (torn.file, torn.line, torn.offset) == (str(path), 4, len(whole))
    assert str(torn).startswith(f"{path}: line 4: torn last line skipped")
    assert complete_length(path, on_torn=lambda _: None) == len(whole)


def test_gzip_cut_at_a_member_boundary_is_whole(tmp_path: Path) -> None:
    members = _members(PROGRAMS)
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(b"".join(members[:-1]))
    notes: list[TornLine] = []
    assert read_traceset(path, on_torn=notes.append).programs == tuple(PROGRAMS[:-1])
    assert notes == []


@pytest.mark.parametrize("tail", [b"\0" * 300, b"\x1f", b"\x1f\x8b\x08\0garbage-not-deflate"])
def test_gzip_undecodable_tail_is_torn(tmp_path: Path, tail: bytes) -> None:
    """What a machine crash can leave: zeros where the last member was, a member begun."""
    members = _members(PROGRAMS)
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(b"".join(members[:-1]) + members[-1][:40] + tail)
    notes: list[TornLine] = []
    assert read_traceset(path, on_torn=notes.append).programs == tuple(PROGRAMS[:-1])
    assert [n.line for n in notes] == [4]


def test_default_note_is_a_logged_warning(tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    members = _members(PROGRAMS)
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(b"".join(members)[:-5])
    with caplog.at_level(logging.WARNING, logger="mori.traces"):
        assert len(read_traceset(path, hashes=False)) == 2
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert f"{path}: line 4: torn last line skipped" in record.getMessage()


def test_gzip_broken_middle_member_raises(tmp_path: Path) -> None:
    members = _members(PROGRAMS)
    broken = members[2][:20] + b"\xff" * 30 + members[2][50:]
    path = tmp_path / "r.jsonl.gz"
    path.write_bytes(members[0] + members[1] + broken + members[3])
    with pytest.raises(TraceError, match=r"r\.jsonl\.gz: line 3: cannot read"):
        read_traceset(path, on_torn=lambda n: pytest.fail(f"noted {n}"))
    bad_json = gzip.compress(b'{"name": "cut\n', mtime=0)
    path.write_bytes(members[0] + members[1] + bad_json + members[3])
    with pytest.raises(TraceError, match=r"r\.jsonl\.gz: line 3, column \d+: invalid JSON"):
        read_traceset(path)


def test_gzip_cut_through_a_member_of_several_lines_raises(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl.gz"
    write_programs(path, "w", PROGRAMS)  # one member for the whole file
    path.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(TraceError, match=r"w\.jsonl\.gz: line \d: cannot read: .*several"):
        read_traceset(path)
    with pytest.raises(TraceError):
        complete_length(path)


def test_gzip_torn_header_raises(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl.gz"
    path.write_bytes(_members([])[0][:-3])
    with pytest.raises(TraceError, match=r"h\.jsonl\.gz: line 1: cannot read"):
        read_traceset(path)


def _plain(programs: list[ProgramTrace]) -> bytes:
    return encode_header("rec") + b"".join(encode_program(p) for p in programs)


@pytest.mark.parametrize("keep", [1, 10, -2])
def test_plain_torn_last_line(tmp_path: Path, keep: int) -> None:
    whole = _plain(PROGRAMS[:-1])
    last = encode_program(PROGRAMS[-1])
    path = tmp_path / "r.jsonl"
    path.write_bytes(whole + last[:keep])
    notes: list[TornLine] = []
    assert read_traceset(path, on_torn=notes.append).programs == tuple(PROGRAMS[:-1])
    assert [(n.line, n.offset) for n in notes] == [(4, len(whole))]
    assert "invalid JSON" in notes[0].reason
    assert complete_length(path, on_torn=lambda _: None) == len(whole)


def test_plain_last_line_without_newline_but_whole_is_read(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_bytes(_plain(PROGRAMS)[:-1])
    notes: list[TornLine] = []
    assert read_traceset(path, on_torn=notes.append).programs == tuple(PROGRAMS)
    assert notes == []


def test_plain_broken_middle_line_raises(tmp_path: Path) -> None:
    lines = _plain(PROGRAMS).splitlines(keepends=True)
    lines[2] = lines[2][:25] + b"\n"  # a torn line, then more lines
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"".join(lines))
    with pytest.raises(TraceError, match=r"r\.jsonl: line 3, column \d+: invalid JSON"):
        read_traceset(path, on_torn=lambda n: pytest.fail(f"noted {n}"))
    path.write_bytes(b"".join(lines[:3]))  # the broken line is last but has its newline
    with pytest.raises(TraceError, match=r"line 3, column \d+: invalid JSON"):
        read_traceset(path)


def test_plain_torn_header_raises(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    path.write_bytes(encode_header("rec")[:-9])
    with pytest.raises(TraceError, match=r"h\.jsonl: line 1, column \d+: invalid JSON"):
        read_traceset(path)
