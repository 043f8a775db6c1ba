"""The trace recorder of ``mori serve --record``: programs as the gateway saw them, written
to a canonical trace file one line per ended program."""

from __future__ import annotations

import builtins
import gzip
import json
import logging
import os
import threading
from pathlib import Path
from typing import IO, Any

import pytest

import mori.gateway.record as record_mod
from mori.cli.main import main as mori_main
from mori.gateway.record import (
    TEXT_CUT_MARKER,
    StepRecord,
    TraceRecorder,
    check_record_file,
)
from mori.traces import (
    GapKind,
    ProgramTrace,
    Step,
    SubagentSpawn,
    TraceError,
    TraceSet,
    load_traces,
    read_traceset,
    write_traceset,
)
from mori.traces.jsonl import TornLine, encode_program

T0 = 1_700_000_000.0  # wall-clock seconds


def rec(arrival: float, ended: float, prompt: int = 1000, cached: int | None = None,
        output: int = 50, tools: tuple[str, ...] = (), text: str | None = None) -> StepRecord:
    return StepRecord(T0 + arrival, T0 + ended, prompt, cached, output, tools, text)


def start(r: TraceRecorder, pid: str, parent: str | None = None, at: float = 0.0) -> None:
    r.start(pid, recogniser="claude-code", agent="main" if parent is None else "sub",
            session="s1", parent=parent, at=T0 + at)


def lines(path: Path) -> list[dict[str, Any]]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [json.loads(line) for line in raw.splitlines()]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_program_round_trips_to_steps(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"rec{suffix}"
    r = TraceRecorder(path)
    start(r, "k0/session-abc")
    r.step("k0/session-abc", rec(0.0, 2.0, 1000, None, 40, ("Read", "Bash", "Read")))
    r.step("k0/session-abc", rec(3.5, 4.25, 1200, 1100, 60))  # cached > previous prompt
    r.step("k0/session-abc", rec(64.25, 65.0, 1500, 1200, 70, ("Edit",)))
    r.step("k0/session-abc", rec(65.5, 66.0, 1600, 2000, 5))  # engine says more than prompt
    r.end("k0/session-abc", T0 + 100)
    r.close(T0 + 101)
    ts = read_traceset(path)
    assert ts.name == "mori-serve"
    (p,) = ts.programs
    assert p.name == "k0/session-abc" and p.source == "mori serve"
    assert p.provider == "claude"  # recognised as Claude Code: `trace stats` splits by it
    assert p.steps == (
        Step(1000, 40, 1.5, GapKind.TOOL, 0, new_tokens=None, call_s=2.0,
             tool_names=("Read", "Bash", "Read")),
        Step(1200, 60, 60.0, GapKind.HUMAN, 1000, new_tokens=100, call_s=0.75),
        Step(1500, 70, 0.5, GapKind.TOOL, 1200, new_tokens=300, call_s=0.75,
             tool_names=("Edit",)),
        Step(1600, 5, 0.0, GapKind.END, 1500, new_tokens=0, call_s=0.5),
    )
    (obj,) = lines(path)[1:]
    assert {k: obj[k] for k in ("recogniser", "agent", "session", "arrival_s")} == {
        "recogniser": "claude-code", "agent": "main", "session": "s1", "arrival_s": T0}
    assert "parent" not in obj


def test_first_step_reuse_and_clamps(tmp_path: Path) -> None:
    """The first step reuses nothing of its own program (the engine's hit there is a shared
    prefix); overlapping requests and a clock stepping back give no negative duration."""
    path = tmp_path / "rec.jsonl"
    r = TraceRecorder(path)
    r.step("p", rec(10.0, 12.0, 800, 512, 10, ("Read",)))
    r.step("p", rec(11.0, 10.5, 900, 800, 10))  # arrived before the first ended
    r.close(T0 + 20)
    (p,) = read_traceset(path).programs
    assert [(s.reuse_tokens, s.new_tokens, s.call_s, s.gap_s) for s in p.steps] == [
        (0, 288, 2.0, 0.0), (800, 100, 0.0, 0.0)]
    (obj,) = lines(path)[1:]
    assert obj["recogniser"] == "unknown"  # stepped without a start


def test_subagent_nested_in_the_step_before_it(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl.gz"
    r = TraceRecorder(path)
    start(r, "k0/main")
    r.step("k0/main", rec(0.0, 1.0, tools=("Task",)))
    r.step("k0/main", rec(2.0, 3.0, tools=("Task",)))  # spawns both subagents
    start(r, "k0/sub-a", parent="k0/main", at=3.5)
    r.step("k0/sub-a", rec(3.5, 4.0, 300, tools=("Grep",)))
    r.step("k0/sub-a", rec(5.0, 6.0, 400, 300))
    start(r, "k0/sub-b", parent="k0/main", at=3.25)
    r.step("k0/sub-b", rec(3.25, 9.0, 200))
    r.end("k0/sub-a", T0 + 7)
    r.end("k0/sub-b", T0 + 10)
    r.step("k0/main", rec(10.0, 11.0))
    r.end("k0/main", T0 + 12)
    r.close(T0 + 13)
    assert r.written == 1
    (p,) = read_traceset(path).programs
    assert [s.gap_kind for s in p.steps] == [GapKind.TOOL, GapKind.SUBAGENT, GapKind.END]
    spawning = p.steps[1]
    assert spawning.gap_s == 1.0  # main's next arrival (10) - the last subagent's end (9)
    assert [(s.delay_s, s.program.name) for s in spawning.subagents] == [
        (0.25, "k0/sub-b"), (0.5, "k0/sub-a")]
    sub_a = spawning.subagents[1].program
    assert sub_a.steps == (
        Step(300, 50, 1.0, GapKind.TOOL, 0, call_s=0.5, tool_names=("Grep",)),
        Step(400, 50, 0.0, GapKind.END, 300, new_tokens=100, call_s=1.0))
    nested = lines(path)[1]["steps"][1]["subagents"]
    assert nested[0]["program"]["parent"] == "k0/main"
    assert nested[0]["program"]["arrival_s"] == T0 + 3.25


def test_subagent_that_cannot_nest_stands_alone(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    r = TraceRecorder(path)
    start(r, "main")
    r.step("main", rec(0.0, 1.0, tools=("Task",)))
    start(r, "early", parent="main")  # arrived before any step of main ended
    r.step("early", rec(0.5, 2.0))
    r.end("early", T0 + 2)
    start(r, "late", parent="main")  # outlives its parent
    r.step("late", rec(1.5, 2.5))
    start(r, "orphan", parent="nobody")
    r.step("orphan", rec(1.0, 1.5))
    r.end("orphan", T0 + 2)
    start(r, "empty", parent="main")  # no step: not written
    r.end("empty", T0 + 2)
    r.end("main", T0 + 3)
    r.end("late", T0 + 4)
    r.close(T0 + 5)
    ts = read_traceset(path)
    assert [p.name for p in ts.programs] == ["orphan", "main", "early", "late"]
    assert all(not s.subagents for p in ts.programs for s in p.steps)
    assert ts.programs[1].steps[-1].gap_kind is GapKind.END


def test_close_writes_open_programs_subagents_nested(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl.gz"
    r = TraceRecorder(path)
    start(r, "main")
    r.step("main", rec(0.0, 1.0, tools=("Task",)))
    start(r, "sub", parent="main")
    r.step("sub", rec(1.5, 2.0))
    start(r, "idle")
    start(r, "idle", at=99)  # a known id: no second program
    r.step("idle", rec(0.0, 0.5))
    assert lines(path)[1:] == []  # nothing ended yet
    r.close(T0 + 3)
    r.close(T0 + 4)  # idempotent
    r.step("main", rec(5.0, 6.0))  # after close: ignored
    ts = read_traceset(path)
    assert sorted(p.name for p in ts.programs) == ["idle", "main"]
    main = next(p for p in ts.programs if p.name == "main")
    assert main.steps[0].gap_kind is GapKind.SUBAGENT and main.steps[0].gap_s == 0.0
    assert main.steps[0].subagents == (SubagentSpawn(
        0.5, ProgramTrace("sub", (Step(1000, 50, 0.0, GapKind.END, call_s=0.5),),
                          source="mori serve", provider="claude")),)


def test_each_line_is_flushed_when_its_program_ends(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl.gz"
    r = TraceRecorder(path)
    for n in range(3):
        r.step(f"p{n}", rec(n, n + 0.5))
        r.end(f"p{n}", T0 + n + 1)
        r.flush()  # written by the writer thread, off the caller's
        # readable while the recorder is open, as after a crash
        assert [p.name for p in read_traceset(path).programs] == [f"p{i}" for i in range(n + 1)]
    r.close(T0 + 9)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_appends_to_an_existing_trace(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"rec{suffix}"
    write_traceset(TraceSet("earlier", (ProgramTrace("x", (Step(5, 1, 0.0, GapKind.END),)),)),
                   path)
    for pid in ("a", "b"):
        r = TraceRecorder(path, name="ignored")
        r.step(pid, rec(0.0, 1.0))
        r.close(T0 + 2)
    ts = read_traceset(path)
    assert ts.name == "earlier"
    assert [p.name for p in ts.programs] == ["x", "a", "b"]
    assert sum(1 for obj in lines(path) if "format" in obj) == 1


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_a_torn_last_line_is_cut_before_appending(tmp_path: Path, suffix: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / f"rec{suffix}"
    r = TraceRecorder(path)
    for pid in ("a", "b"):
        r.step(pid, rec(0.0, 1.0))
        r.end(pid, T0 + 2)
    r.close(T0 + 3)
    path.write_bytes(path.read_bytes()[:-7])  # a crash while "b" was written
    with caplog.at_level(logging.WARNING):
        r = TraceRecorder(path)
    assert any("torn last line" in m for m in caplog.messages)
    r.step("c", rec(0.0, 1.0))
    r.close(T0 + 4)
    notes: list[TornLine] = []
    assert [p.name for p in read_traceset(path, on_torn=notes.append).programs] == ["a", "c"]
    assert notes == []


@pytest.mark.parametrize(("name", "content", "message"), [
    ("notes.jsonl", b'{"role": "user"}\n', "line 1: not a header"),
    ("notes.jsonl.gz", b"plain text\n", "line 1: cannot read"),
    ("broken.jsonl", b'{"format":"mori-trace","version":2,"name":"s"}\n{}\n{oops\n',
     "its last line: invalid JSON"),
    ("broken.jsonl.gz", gzip.compress(b'{"format":"mori-trace","version":2,"name":"s"}\n')
     + b"not a gzip member" * 4, "no whole gzip member ends it"),
    ("trace.txt", b"", "must end in .jsonl or .jsonl.gz"),
])
def test_a_file_that_is_no_trace_is_refused(tmp_path: Path, name: str, content: bytes,
                                            message: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    for check in (TraceRecorder, check_record_file):
        with pytest.raises(TraceError) as info:
            check(path)
        text = str(info.value)
        assert text.startswith(f"{path}: ") and "cannot record into it" in text
        assert message in text
    assert path.read_bytes() == content  # left alone
    new = tmp_path / "new.jsonl.gz"
    check_record_file(new)  # fine, and nothing written
    assert not new.exists()


def test_text_only_when_kept(tmp_path: Path) -> None:
    for keep in (False, True):
        path = tmp_path / f"rec-{keep}.jsonl"
        r = TraceRecorder(path, keep_text=keep)
        r.step("p", rec(0.0, 1.0, tools=("Read",), text="secret prompt"))
        r.step("p", rec(2.0, 3.0, text=None))
        r.close(T0 + 4)
        raw = path.read_text()
        assert ("secret prompt" in raw) is keep
        steps = lines(path)[1]["steps"]
        assert [s.get("text") for s in steps] == (
            ["secret prompt", None] if keep else [None, None])


def test_text_is_capped_per_program_with_a_marker(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    r = TraceRecorder(path, keep_text=True, text_max_bytes=100)
    r.step("p", rec(0.0, 1.0, text="a" * 60))
    r.step("p", rec(2.0, 3.0, text="\u00e9" * 30))  # 60 bytes: 40 fit, a character cut
    r.step("p", rec(4.0, 5.0, text="later"))
    r.step("p", rec(6.0, 7.0, text=""))
    r.step("q", rec(0.0, 1.0, text="b" * 100))  # its own bound: whole
    r.close(T0 + 8)
    by_name = {obj["name"]: [st.get("text") for st in obj["steps"]]
               for obj in lines(path)[1:]}
    assert by_name["p"] == ["a" * 60, "\u00e9" * 20 + TEXT_CUT_MARKER, TEXT_CUT_MARKER, ""]
    assert by_name["q"] == ["b" * 100]
    # what an open program holds is bounded too, not only what is written
    r = TraceRecorder(tmp_path / "held.jsonl", keep_text=True, text_max_bytes=1000)
    for i in range(20):
        r.step("big", rec(i, i + 0.5, text="x" * 100_000))
    held = sum(len(s.text or "") for s in r._open["big"].steps)
    assert held <= 1000 + 20 * len(TEXT_CUT_MARKER)
    r.close(T0 + 30)


def test_lines_are_encoded_and_written_off_the_callers_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real = encode_program

    def spy(*args: Any, **kwargs: Any) -> bytes:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(record_mod, "encode_program", spy)
    r = TraceRecorder(tmp_path / "rec.jsonl.gz", keep_text=True)
    for n in range(3):
        r.step(f"p{n}", rec(n, n + 0.5, text="t" * 1000))
        r.end(f"p{n}", T0 + n + 1)
    r.close(T0 + 9)
    assert threads == ["mori record"] * 3
    assert r.written == 3


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_reopening_reads_the_head_and_the_tail_not_the_whole_file(
        tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / f"rec{suffix}"
    r = TraceRecorder(path, keep_text=True, text_max_bytes=1 << 20)
    for n in range(24):  # 12 MB of text, 7 MB gzipped
        r.step(f"p{n}", rec(n, n + 0.5, text=os.urandom(256 * 1024).hex()))
        r.end(f"p{n}", T0 + n + 1)
    r.close(T0 + 30)
    size = path.stat().st_size
    assert size > 6 * 1024 * 1024
    read = [0]

    class Counting:
        def __init__(self, f: IO[bytes]) -> None:
            self.f = f
            self.name = f.name

        def __getattr__(self, name: str) -> Any:
            return getattr(self.f, name)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def read(self, n: int = -1) -> bytes:
            data = self.f.read(n)
            read[0] += len(data)
            return data

        def readline(self, n: int = -1) -> bytes:
            data = self.f.readline(n)
            read[0] += len(data)
            return data

    real_open = builtins.open

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(file, mode, *args, **kwargs)
        return Counting(f) if mode == "rb" else f

    monkeypatch.setattr(builtins, "open", counting_open)
    check_record_file(path)
    assert read[0] < 3 * 1024 * 1024, f"{read[0]} of {size} bytes read to check the file"
    # and a torn last line (a crash while writing one) is still found from the end
    with open(path, "ab") as f:
        f.write(gzip.compress(b'{"name": "torn"}\n')[:-9] if suffix == ".jsonl.gz"
                else b'{"name": "to')
    read[0] = 0
    r = TraceRecorder(path)
    r.step("after", rec(0.0, 1.0))
    r.close(T0 + 40)
    assert read[0] < 3 * 1024 * 1024
    monkeypatch.undo()
    names = [p.name for p in read_traceset(path).programs]
    assert names == [f"p{n}" for n in range(24)] + ["after"]


ODD = ["k0/session-abc", "anon-\u00e9\u6f22 \"quoted\"\n\ttab", "../../etc/passwd", ""]


def test_recorded_file_feeds_stats_and_simulate(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rec.jsonl.gz"
    r = TraceRecorder(path)
    for n, pid in enumerate(ODD):
        t = n * 10.0
        start(r, pid)
        r.step(pid, rec(t, t + 1.0, 2000, None, 100, ("Read",)))
        r.step(pid, rec(t + 1.5, t + 3.0, 2400, 2000, 80, ("Task",)))
        sub = f"{pid}/sub"
        start(r, sub, parent=pid)
        r.step(sub, rec(t + 3.1, t + 4.0, 500, None, 20))
        r.end(sub, T0 + t + 4.0)
        r.step(pid, rec(t + 5.0, t + 6.0, 3000, 2400, 90))
        r.end(pid, T0 + t + 7)
    r.close(T0 + 60)
    assert [p.name for p in load_traces(path).programs] == ODD
    assert mori_main(["trace", "stats", str(path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["main"]["programs"] == len(ODD) and stats["subagents"]["programs"] == len(ODD)
    assert mori_main(["simulate", "--traces", str(path), "--policy", "mori", "--programs", "2",
                      "--duration", "60", "--quiet"]) == 0
    assert "mori" in capsys.readouterr().out


def test_a_requests_text_is_cut_past_the_cap_before_it_travels() -> None:
    """The prompt text a request hands on (to the policy process, from a worker) is at most
    one character past ``--record-text-max-bytes``: a huge prompt does not ride the worker
    link whole, and the recorder still sees it was longer and marks the cut."""
    from types import SimpleNamespace

    from mori.gateway.config import GatewaySettings
    from mori.gateway.endpoint import CompletionEndpoint
    from mori.gateway.parsing import parse_request

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * 50_000}],
                       "program_id": "p"}).encode()
    req = parse_request("/v1/chat/completions", body, None)
    for record_text, cap, expect in ((True, 100, 101), (True, 0, 1), (False, 100, None)):
        settings = GatewaySettings(record_text=record_text, record_text_max_bytes=cap)
        gw = SimpleNamespace(settings=settings, anonymous_id=lambda: "anon")
        facts, _ = CompletionEndpoint(gw)._name_program(req, {}, lambda s: s)
        assert (None if facts.text is None else len(facts.text)) == expect
