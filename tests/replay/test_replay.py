"""``mori replay`` against a tiny in-test OpenAI-compatible server.

Time scales are large (10 simulated seconds a wall second), so each replay takes a
few wall seconds; tolerances on times are in simulated seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mori.cli.replay_cmd import add_replay_parser, run_replay
from mori.replay import ReplayConfig, ReplayResult, RequestRecord, TargetError, replay
from mori.sim.config import SimConfig
from mori.sim.plan import ReplayPlan
from mori.sim.runner import Simulation
from mori.traces import write_traceset
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet
from support.fake_engine import FakeEngine
from support.loop_thread import LoopThread

SCALE = 10.0
LATE_WALL_S = 0.3  # wall seconds a request may come after its due time (a loaded 2-core
# machine has been seen to run 160 ms late)
LATE = LATE_WALL_S * SCALE  # the same, in simulated seconds
EARLY = 0.05

CHILD = ProgramTrace("C", (Step(50, 4, 2.0, GapKind.TOOL),
                           Step(80, 2, 0.0, GapKind.END, 50)))
PARENT = ProgramTrace("P", (
    Step(100, 5, 4.0, GapKind.SUBAGENT, 0, (SubagentSpawn(1.0, CHILD),)),
    Step(300, 3, 2.0, GapKind.TOOL, 100),
    Step(400, 2, 0.0, GapKind.END, 300)))
SOLO = ProgramTrace("Q", (Step(200, 3, 500.0, GapKind.HUMAN),  # capped to 2.5 s below
                          Step(260, 4, 0.0, GapKind.END, 200)))
TRACES = TraceSet("tiny", (PARENT, SOLO))
BY_NAME = {p.name: p for p in (PARENT, SOLO, CHILD)}
GAPS = {("P", 1): 2.0, ("Q", 0): 2.5, ("C", 0): 2.0}


@contextlib.contextmanager
def serving(**kw: Any) -> Iterator[FakeEngine]:
    """A fake engine serving the model "tiny" on its own loop thread (the replay runs in
    this one); a broken connection comes after the first token."""
    lt = LoopThread()
    try:
        fake = lt.call(FakeEngine(model="tiny", die_after=1, **kw).start())
        lt.handles.append(fake)
        yield fake
    finally:
        lt.close()


@pytest.fixture
def server() -> Iterator[FakeEngine]:
    with serving() as s:
        yield s


@pytest.fixture(scope="module")
def engine_run() -> Iterator[tuple[FakeEngine, ReplayResult]]:
    """One replay against an engine-like server, shared by the tests that only look."""
    with serving() as s:
        yield s, run(config(s))


def run(cfg: ReplayConfig, traces: TraceSet = TRACES) -> ReplayResult:
    t0 = time.monotonic()
    result = asyncio.run(replay(cfg, traces))
    # never hangs: the run ends on time, in-flight requests cancelled
    assert time.monotonic() - t0 < cfg.duration_s / cfg.time_scale + 5.0
    return result


def config(server: FakeEngine, **kw: Any) -> ReplayConfig:
    base: dict[str, Any] = dict(programs=2, duration_s=40.0, time_scale=SCALE, stagger_s=0.0,
                                human_gap_cap_s=2.5, seed=0)
    base.update(kw)
    return ReplayConfig(server.url, **base)


def by_program(bodies: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for b in bodies:
        out[b["program_id"]].append(b)
    return out


def events_of(result: ReplayResult) -> dict[str, list[RequestRecord]]:
    out: dict[str, list[RequestRecord]] = defaultdict(list)
    for e in result.events:
        out[e.program_id].append(e)
    return {pid: sorted(es, key=lambda e: e.step) for pid, es in out.items()}


def test_requests_follow_the_trace(engine_run: tuple[FakeEngine, ReplayResult]) -> None:
    server, result = engine_run
    bodies = server.chat_bodies()
    # (a request sent as the run ends may be cancelled before the server reads it)
    in_flight = sum(e.end_s is None for e in result.events)
    assert len(bodies) <= result.requests <= len(bodies) + in_flight and len(bodies) > 10
    assert result.errors == {} and result.steps == result.requests - in_flight
    # program ids as the simulator names them: NAME#K, K = 1, 2, ... in start order
    numbers = sorted(int(pid.split("#")[1]) for pid in by_program(bodies))
    assert numbers == list(range(1, len(numbers) + 1))
    plan = ReplayPlan.build(TRACES.programs, slots=2, seed=0, stagger_s=0.0,
                            max_context=10**9, human_gap="cap", human_gap_cap_s=2.5)
    first = [plan.programs[i].name for i in plan.order]
    assert [bodies[0]["program_id"], bodies[1]["program_id"]] == [f"{first[0]}#1",
                                                                   f"{first[1]}#2"]
    finished = 0
    for pid, reqs in by_program(bodies).items():
        trace = BY_NAME[pid.split("#")[0]]
        want = [(s.prompt_tokens, s.reuse_tokens, s.output_tokens) for s in trace.steps]
        got = [(b["mori"]["prompt_tokens"], b["mori"]["reuse_tokens"], b["max_tokens"])
               for b in reqs]
        assert got == want[:len(got)], pid  # the steps in order, none skipped or repeated
        finished += got == want
        for b in reqs:
            assert b["model"] == "tiny" and b["stream"] is True
            assert b["stream_options"] == {"include_usage": True}
            assert b["messages"][0]["role"] == "user" and len(b["messages"][0]["content"]) < 40
    assert finished >= result.programs_finished - 1 > 3
    assert result.output_tokens == sum(e.output_tokens for e in result.events)
    # the server's usage, per request (this server reports 5 prompt tokens, no cache)
    done = [e for e in result.events if e.end_s is not None and e.error is None]
    assert done and all(e.prompt_tokens == 5 and e.cached_tokens is None for e in done)


def test_gaps_and_subagents_in_scaled_time(engine_run: tuple[FakeEngine, ReplayResult]
                                           ) -> None:
    server, result = engine_run
    ev = events_of(result)
    checked = {"gap": 0, "subagent": 0}
    for pid, es in ev.items():
        name = pid.split("#")[0]
        for a, b in zip(es, es[1:], strict=False):
            if (name, a.step) in GAPS and a.end_s is not None:
                gap = b.sent_s - a.end_s
                assert GAPS[name, a.step] - EARLY <= gap <= GAPS[name, a.step] + LATE, (pid, gap)
                checked["gap"] += 1
        if name != "P" or len(es) < 2:
            continue
        # the parent waits while its subagent runs: spawned 1 s after the parent's first
        # response, the parent's next request 4 s (the residual gap) after the child ends
        e0, s1 = es[0].end_s, es[1].sent_s
        assert e0 is not None
        # (another P may run at the same time: its child is the one spawned ~1 s after)
        kids = [k for k, kes in ev.items() if k.startswith("C#") and e0 < kes[0].sent_s < s1]
        assert kids, pid
        kid = min((ev[k] for k in kids), key=lambda kes: abs(kes[0].sent_s - e0 - 1.0))
        assert 1.0 - EARLY <= kid[0].sent_s - e0 <= 1.0 + LATE
        assert len(kid) == 2 and kid[-1].end_s is not None and kid[-1].end_s < s1
        assert 4.0 - EARLY <= s1 - kid[-1].end_s <= 4.0 + LATE
        checked["subagent"] += 1
    assert checked["gap"] >= 4 and checked["subagent"] >= 2
    # the server saw the gaps too, in wall time (scaled)
    q = [r for r in server.requests if r.body["program_id"].startswith("Q#")]
    pairs = [(r1, r2) for r1, r2 in zip(q, q[1:], strict=False)
             if r1.body["program_id"] == r2.body["program_id"]]
    assert pairs
    for r1, r2 in pairs:
        assert r1.finished is not None
        assert (r2.arrived - r1.finished) * SCALE >= 2.5 - 0.2


def test_release_is_tried_once_against_an_engine(engine_run: tuple[FakeEngine, ReplayResult]
                                                  ) -> None:
    server, result = engine_run
    assert result.programs_finished > 3
    assert len(server.releases) == 1  # answered 404: not asked again
    assert result.release_errors == 0 and result.errors == {}
    assert not result.gateway and result.promotions is None


def test_gateway_counters_and_releases() -> None:
    with serving(gateway=True) as server:
        result = run(config(server, duration_s=20.0))
    assert result.gateway
    n = len(server.requests)
    assert result.promotions == n and result.demotions_to_cpu == 2 * n  # counted over the run
    assert result.demotions_to_none == 0  # declared, never incremented
    assert result.held_requests is None  # not exposed
    # every finished program released, and the ones still live at the end
    assert len(server.releases) >= result.programs_finished
    assert len(set(server.releases)) == len(server.releases)
    assert all("#" in pid for pid in server.releases)


def test_errors_are_counted_and_programs_go_on() -> None:
    with serving(fail=lambda b, n: 500 if n % 5 == 1 else None,
                 stream_error=lambda b, n: n % 5 == 3) as server:
        result = run(config(server))
    done = {(e.program_id, e.step) for e in result.events if e.end_s is not None}
    seen = [r for r in server.requests if (r.body["program_id"], stepno(r.body)) in done]
    assert result.errors == {"http_500": sum(r.status == 500 for r in seen),
                             "stream": sum(r.status == 599 for r in seen)}
    assert result.errors["http_500"] >= 2 and result.errors["stream"] >= 2
    assert result.error_count == sum(result.errors.values())
    assert result.steps + result.error_count == len(done)
    # a failed step is not retried: the program goes on with its next step
    for pid, reqs in by_program(server.chat_bodies()).items():
        trace = BY_NAME[pid.split("#")[0]]
        got = [b["mori"]["prompt_tokens"] for b in reqs]
        assert got == [s.prompt_tokens for s in trace.steps][:len(got)]


def test_a_broken_connection_is_a_stream_error() -> None:
    with serving(die=lambda b, n: n % 3 == 0) as server:
        result = run(config(server, duration_s=20.0))
    assert set(result.errors) == {"stream"} and result.errors["stream"] >= 2
    assert result.steps >= 2


def stepno(body: dict[str, Any]) -> int:
    return int(body["messages"][0]["content"].rsplit(" ", 1)[1]) - 1


def test_end_on_error_ends_the_program() -> None:
    with serving(fail=lambda b, n: 503 if b["program_id"].startswith("Q#") else None
                 ) as server:
        result = run(config(server, end_on_error=True, duration_s=20.0))
    q = [b for b in server.chat_bodies() if b["program_id"].startswith("Q#")]
    assert q and all(b["mori"]["reuse_tokens"] == 0 for b in q)  # never a second step
    assert result.errors.get("http_503", 0) >= len(q) - 1


def test_a_request_that_never_answers_times_out() -> None:
    with serving(hang=lambda b, n: n == 0) as server:
        result = run(config(server, request_timeout_s=0.6, duration_s=40.0))
    assert result.errors == {"timeout": 1}, result.errors
    hung = [e for e in result.events if e.error == "timeout"]
    assert hung[0].end_s is not None and hung[0].end_s - hung[0].sent_s >= 0.6 * SCALE - EARLY
    assert result.steps > 3


def test_a_run_ends_on_time_with_requests_hanging() -> None:
    with serving(hang=lambda b, n: True) as server:
        t0 = time.monotonic()
        result = run(config(server, duration_s=10.0))
    assert time.monotonic() - t0 < 3.0
    assert result.steps == 0 and result.errors == {}
    assert result.requests == 2 and all(e.end_s is None for e in result.events)


def test_text_prompts_keep_the_reused_prefix() -> None:
    long = ProgramTrace("L", (Step(400, 20, 1.0, GapKind.TOOL),
                              Step(800, 20, 1.0, GapKind.TOOL, 400),
                              Step(1000, 10, 1.0, GapKind.TOOL, 600),
                              Step(1200, 10, 0.0, GapKind.END, 1000)))
    with serving(max_model_len=110) as server:
        result = run(config(server, programs=1, text_prompts=True, token_scale=0.1,
                            duration_s=20.0), TraceSet("long", (long,)))
    # the context window is the model's 110 tokens / 0.1: the last step (1210) is cut
    assert result.max_context == 1100
    reqs = by_program(server.chat_bodies())
    assert all(len(r) <= 3 for r in reqs.values())
    full = [r for r in reqs.values() if len(r) == 3]
    assert full
    for r in full:
        texts = [b["messages"][0]["content"] for b in r]
        assert [b["max_tokens"] for b in r] == [2, 2, 1]
        assert all("mori" not in b and "program_id" in b for b in r)
        assert [len(t) for t in texts] == [160, 320, 400]  # 4 characters a token
        assert texts[1].startswith(texts[0])  # reuse 40 of 40 tokens: append only
        assert texts[2][:240] == texts[1][:240] and texts[2][240:] != texts[1][240:320]
    assert len({r[0]["messages"][0]["content"][:40] for r in reqs.values()}) == len(reqs)


def test_program_ids_match_the_simulators() -> None:
    traces = TraceSet("four", tuple(
        ProgramTrace(f"p{i}", (Step(100, 2, 50.0, GapKind.TOOL),
                               Step(200, 2, 0.0, GapKind.END, 100))) for i in range(4)))
    sim = Simulation(SimConfig(programs=3, seed=4, stagger_s=10.0, duration_s=9.0,
                               hardware="h200-80g-qwen2.5-7b"), traces)
    sim.run()
    with serving() as server:
        result = run(ReplayConfig(server.url, programs=3, seed=4, stagger_s=10.0,
                                  duration_s=9.0, time_scale=SCALE), traces)
    assert sorted(e.program_id for e in result.events) == sorted(sim.live)
    starts = {e.program_id: e.sent_s for e in result.events}
    for pid, t in zip(("p2#1", "p0#2", "p3#3"), sim.plan.start_times[::-1], strict=True):
        assert t - EARLY <= starts[pid] <= t + LATE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_unreachable_target() -> None:
    cfg = ReplayConfig(f"http://127.0.0.1:{free_port()}", programs=1, duration_s=5.0)
    with pytest.raises(TargetError, match="cannot reach"):
        asyncio.run(replay(cfg, TRACES))


# -- the command --------------------------------------------------------------------------
def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mori")
    add_replay_parser(parser.add_subparsers(dest="command"))
    return run_replay(parser.parse_args(["replay", *argv]))


def test_cli_writes_table_json_and_events(server: FakeEngine, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    traces = tmp_path / "tiny.jsonl"
    write_traceset(TRACES, traces)
    out, events = tmp_path / "r.json", tmp_path / "ev.jsonl"
    status = cli("--target", server.url + "/v1/", "--traces", str(traces), "--programs", "2",
                 "--duration", "20", "--time-scale", "20", "--stagger", "0", "--json", str(out),
                 "--events", str(events), "--quiet")
    assert status == 0
    text = capsys.readouterr().out
    assert "tok/s" in text and "TTFT p99 (s)" in text and server.url in text
    rows = json.loads(out.read_text())
    assert len(rows) == 1
    r = rows[0]
    assert r["traces"] == "tiny" and r["programs"] == 2 and r["model"] == "tiny"
    for key in ("output_tokens_per_s", "steps_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
                "ttft_p99_s", "requests", "programs_started", "programs_finished", "errors"):
        assert key in r
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert len(lines) == r["requests"]
    assert set(lines[0]) == {"program_id", "step", "sent_s", "first_token_s", "end_s",
                             "output_tokens", "error", "prompt_tokens", "cached_tokens"}


def test_cli_unreachable_target_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert cli("--target", url, "--programs", "1", "--duration", "5") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach" in err[0] and "--target" in err[0]


@pytest.mark.parametrize("argv, message", [
    (["--programs", "1"], "--target is required"),
    (["--target", "http://x", "--programs", "0"], "programs must be >= 1"),
    (["--target", "localhost:8000", "--programs", "1"], "http:// or https://"),
    (["--target", "http://x", "--programs", "1", "--time-scale", "0"], "time scale"),
])
def test_cli_usage_errors(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_fake_server_module_is_importable() -> None:
    assert "support.fake_engine" in sys.modules
