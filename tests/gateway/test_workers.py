"""``mori serve --workers N``: several gateway processes on one port, one policy.

Through real processes: every step of every program reaches the policy whichever
process served it, held requests are admitted across processes, keys hold on every
process, and ``/metrics`` counts what the workers served; SIGTERM and SIGINT both stop
it with its clean-up done. In-process: a worker that goes away leaves no program
Reasoning (its leases are finished, its waits cancelled), the workers' served models are
the policy process's, and the link carries a request as large as ``--max-body-bytes``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from gateway_harness import LoopThread, serve_on_simulated

from mori.core.types import Status
from mori.engines.http import parse_prometheus
from mori.gateway.agents import RequestFacts
from mori.gateway.config import GatewaySettings
from mori.gateway.ipc import MAX_FRAME, FrameTooLarge, WorkerLink, frame_limit
from mori.gateway.worker_pool import WorkerHub
from support.serve_process import stop, wait_listening

KEY = "sk-worker-test-key"


def start_serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--port", "0",
                             "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        return proc, wait_listening(proc)
    except BaseException:
        stop(proc)
        raise


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return {",".join(f"{k}={v}" for k, v in sorted(labels.items())): v
            for labels, v in parse_prometheus(text).get(name, [])}


def run_programs(url: str, n: int, steps: int, key: str = "none",
                 synthetic: int | None = None, together: bool = False) -> None:
    """``n`` programs of ``steps`` steps each, one thread (and connection) a program;
    ``together``: every program sends its first request at once (a barrier)."""
    start = threading.Barrier(n) if together else None

    def one(i: int) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        model = c.models.list().data[0].id
        if start is not None:
            start.wait(timeout=60)
        for _ in range(steps):
            extra: dict[str, object] = {"program_id": f"p{i}"}
            if synthetic is not None:
                extra["mori"] = {"prompt_tokens": synthetic}
            r = c.chat.completions.create(model=model, max_tokens=2, extra_body=extra,
                                          messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content is not None
        c.close()

    with ThreadPoolExecutor(n) as ex:
        list(ex.map(one, range(n)))


@pytest.fixture(scope="module")
def three() -> Iterator[str]:
    proc, url = start_serve("--workers", "3", "--time-scale", "50")
    try:
        yield url
    finally:
        stop(proc)


def test_every_step_reaches_the_one_policy_whichever_process_served_it(three: str) -> None:
    run_programs(three, 16, 5)
    progs = {p["program_id"]: p for p in httpx.get(three + "/v1/programs").json()["data"]}
    assert {f"p{i}" for i in range(16)} <= set(progs)
    for i in range(16):
        p = progs[f"p{i}"]
        assert (p["steps"], p["status"], p["in_flight"]) == (5, "acting", False)
    deadline = time.monotonic() + 10
    while True:  # the workers report their counts twice a second
        served = metric(three, "mori_requests_total")
        ok = served.get("endpoint=/v1/chat/completions,status=200", 0)
        by_worker = metric(three, "mori_worker_requests_total")
        if ok >= 80 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert ok == 80
    # the policy process kept the first connections (their requests need no round trip)
    # and handed the others to the workers in turn
    conns = metric(three, "mori_connections_total")
    assert conns.get("process=policy", 0) >= 1
    assert conns.get("process=worker1", 0) >= 5 and conns.get("process=worker2", 0) >= 5
    assert set(by_worker) == {"worker=1", "worker=2"} and 40 <= sum(by_worker.values()) < 80


def test_held_requests_are_admitted_across_processes() -> None:
    # a GPU tier that holds about two of the six programs, the six first requests sent at
    # once and steps slow enough (time scale 2000) that four of them find it full: held
    # (at time scale 200 a loaded machine could serialize the threads, and hold none)
    proc, url = start_serve("--workers", "2", "--time-scale", "2000", "--gpu-kv-tokens",
                            "20000")
    try:
        run_programs(url, 6, 3, synthetic=8000, together=True)
        progs = httpx.get(url + "/v1/programs").json()["data"]
        assert sorted(p["steps"] for p in progs) == [3] * 6
        assert all(p["status"] != Status.REASONING.value for p in progs)
        held = metric(url, "mori_held_requests_total")
        assert sum(held.values()) > 0
    finally:
        stop(proc)


def test_keys_hold_on_every_process() -> None:
    proc, url = start_serve("--workers", "2", "--api-key", KEY, "--time-scale", "50")
    try:
        for _ in range(12):  # the worker answers; inspection is passed to the policy process
            assert httpx.post(url + "/v1/chat/completions", json={}).status_code == 401
            r = httpx.get(url + "/v1/programs", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200
            assert httpx.get(url + "/v1/decisions",
                             headers={"Authorization": f"Bearer {KEY}"}).status_code == 403
        run_programs(url, 4, 2, key=KEY)
        mine = httpx.get(url + "/v1/programs",
                         headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
        assert sorted(p["program_id"] for p in mine) == ["p0", "p1", "p2", "p3"]
    finally:
        stop(proc)


def test_a_worker_that_goes_away_leaves_no_program_reasoning(tmp_path: object) -> None:
    lt = LoopThread()
    try:
        sim = serve_on_simulated(lt, GatewaySettings(time_scale=50.0, hold_timeout_s=30),
                                 gpu_kv_tokens=20_000)
        hub = WorkerHub(sim.gw)
        path = os.path.join(str(tmp_path), "hub.sock")
        lt.call(hub.start(path))

        async def scenario() -> None:
            link = await WorkerLink.connect(path)
            hello = await link.call({"op": "hello", "worker": "9"})
            assert hello["gpu_tokens"] == sim.gw.gpu_tokens()
            # "a" is admitted and runs; "b" does not fit beside it and is held
            go = await link.call({"op": "admit", "pid": "a", "tokens": 15_000, "anon": False})
            assert go["op"] == "go"
            link.send({"op": "admit", "id": 999, "pid": "b", "tokens": 15_000,
                       "anon": False})
            await asyncio.sleep(0.3)
            assert sim.gw.ctl.policy.programs["a"].status is Status.REASONING
            await link.close()  # the worker dies with "a" running and "b" held
            await asyncio.sleep(0.5)

        lt.call(scenario())
        pol = sim.gw.ctl.policy.programs
        assert pol["a"].status is not Status.REASONING
        assert "b" not in pol or pol["b"].status is not Status.REASONING
        assert not any(info.in_flight for info in sim.gw.ctl.programs.values())
        lt.call(hub.stop())
    finally:
        lt.close()


def children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(c) for c in f.read().split()}


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="needs Linux's /proc children list")
def test_a_killed_worker_is_started_again_and_the_port_keeps_serving() -> None:
    proc, url = start_serve("--workers", "2", "--time-scale", "50")
    try:
        run_programs(url, 2, 1)
        (worker,) = children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        # meanwhile the policy process serves every new connection itself
        run_programs(url, 2, 2)
        deadline = time.monotonic() + 15
        while (again := children(proc.pid) - {worker}) == set() \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(again) == 1
        before = metric(url, "mori_connections_total").get("process=worker1", 0)
        deadline = time.monotonic() + 15
        while True:  # the new worker takes connections once it has connected
            run_programs(url, 4, 1)
            after = metric(url, "mori_connections_total").get("process=worker1", 0)
            if after > before or time.monotonic() > deadline:
                break
        assert after > before
        progs = {p["program_id"]: p for p in httpx.get(url + "/v1/programs").json()["data"]}
        assert progs["p0"]["steps"] >= 4 and progs["p3"]["steps"] >= 1
        assert all(not p["in_flight"] for p in progs.values())
        assert proc.poll() is None
    finally:
        stop(proc)
    assert "gateway worker 1 exited" in (proc.stderr.read() if proc.stderr else "")


def test_agent_sessions_and_tool_calls_reach_the_policy_through_workers(tmp_path: object
                                                                         ) -> None:
    """Claude-Code-like sessions on many connections (most served by the workers): each
    session is one program whose agent kind, tool calls and tool time reach the policy
    process, and the recorded trace holds every step."""
    import json
    from pathlib import Path

    import anthropic

    from mori.traces.jsonl import read_traceset

    tmp = Path(str(tmp_path))
    script = tmp / "script.json"
    script.write_text(json.dumps({"steps": [{"tool": {"Bash": {"command": "ls"}}},
                                            {"text": "Done."}]}))
    record = tmp / "rec.jsonl"
    proc, url = start_serve("--workers", "3", "--engine-script", str(script),
                            "--record", str(record))
    bash = {"name": "Bash", "input_schema": {"type": "object", "properties": {}}}

    def session(i: int) -> None:
        c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60,
                                default_headers={"x-app": "cli"})  # Claude Code's own
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        meta = {"user_id": json.dumps({"session_id": f"s-{i}"})}
        msgs: list[dict[str, object]] = [{"role": "user", "content": f"task {i}"}]
        first = c.messages.create(model=model, max_tokens=50, messages=msgs,  # type: ignore[arg-type]
                                  tools=[bash], metadata=meta)  # type: ignore[list-item]
        call = next(b for b in first.content if b.type == "tool_use")
        time.sleep(0.2)
        msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "ok"}]}]
        c.messages.create(model=model, max_tokens=50, messages=msgs,  # type: ignore[arg-type]
                          tools=[bash], metadata=meta)  # type: ignore[list-item]

    try:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(session, range(6)))
        rows = httpx.get(url + "/v1/programs", timeout=10).json()["data"]
        deadline = time.monotonic() + 10.0
        while True:  # the workers report their counts twice a second
            served = metric(url, "mori_worker_requests_total")
            if sum(served.values()) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        stop(proc)
    assert len(rows) == 6 and {r["agent"] for r in rows} == {"claude-code"}
    assert {r["session"] for r in rows} == {f"s-{i}" for i in range(6)}
    for r in rows:
        assert r["steps"] == 2 and r["tools"] == {"Bash": 1} and r["tool_steps"] == 1
        assert 0.2 <= r["last_tool_s"] < 2.0
    assert sum(served.values()) > 0  # the workers served some of them
    progs = read_traceset(record).programs
    assert len(progs) == 6 and all(len(p.steps) == 2 for p in progs)
    assert all(p.steps[0].tool_names == ("Bash",) for p in progs)


def test_workers_take_the_policy_process_list_of_models(tmp_path: object) -> None:
    """The served models a worker maps names onto are the policy process's: sent at
    hello, refreshed when a worker asks (a name it does not know), pushed to every worker
    when the list changes (an engine now serves another model), and read again when a
    replica comes back."""
    lt = LoopThread()
    try:
        sim = serve_on_simulated(lt, GatewaySettings(time_scale=50.0))
        served = [m["id"] for m in sim.gw.models]
        assert served
        hub = WorkerHub(sim.gw)
        path = os.path.join(str(tmp_path), "hub.sock")
        lt.call(hub.start(path))

        async def new_model() -> list[dict[str, object]]:
            return [{"id": "another-model", "object": "model"}]

        async def back_with() -> list[dict[str, object]]:
            return [{"id": "model-after-restart", "object": "model"}]

        async def scenario() -> tuple[list[str], list[str], list[str]]:
            asker, other = await WorkerLink.connect(path), await WorkerLink.connect(path)
            hello = await asker.call({"op": "hello", "worker": "1"})
            await other.call({"op": "hello", "worker": "2"})
            pushed: list[dict[str, object]] = []
            other.on_message = pushed.append
            sim.adapters[0].models = new_model  # type: ignore[method-assign]
            answer = await asker.call({"op": "models"})
            await asyncio.sleep(0.2)
            sim.adapters[0].models = back_with  # type: ignore[method-assign]
            for tell in sim.gw.ctl.replica_listeners:  # as when replica 0 rejoins
                tell(0, True, "")
            await asyncio.sleep(0.2)
            await asker.close()
            await other.close()
            ids = [[str(m["id"]) for m in msg["models"]]  # type: ignore[attr-defined]
                   for msg in (hello, answer)]
            return ids[0], ids[1], [str(m["id"]) for msg in pushed
                                    for m in msg["models"]]  # type: ignore[attr-defined]

        at_hello, asked, pushed = lt.call(scenario())
        assert at_hello == served
        assert asked == ["another-model"]
        assert pushed == ["another-model", "model-after-restart"]
        assert [m["id"] for m in sim.gw.models] == ["model-after-restart"]
        lt.call(hub.stop())
    finally:
        lt.close()


def test_the_link_carries_a_request_as_large_as_max_body_bytes(tmp_path: object) -> None:
    """A request's recorded text rides in its admission: with --max-body-bytes above the
    link's least frame limit (64 MiB) the limit follows it, so such a request is admitted;
    a message over the limit is refused where it is written and the link goes on."""
    body_limit = MAX_FRAME + 2 * 1024 * 1024
    lt = LoopThread()
    try:
        sim = serve_on_simulated(lt, GatewaySettings(time_scale=50.0, record_text=True,
                                                     max_body_bytes=body_limit))
        hub = WorkerHub(sim.gw)
        assert hub.limit == frame_limit(body_limit) > body_limit
        path = os.path.join(str(tmp_path), "hub.sock")
        lt.call(hub.start(path))
        text = "x" * (MAX_FRAME + 1024 * 1024)

        async def scenario() -> tuple[str, str, str]:
            link = await WorkerLink.connect(path, frame_limit(body_limit))
            await link.call({"op": "hello", "worker": "1"})
            facts = RequestFacts(text=text).as_msg()
            go = await link.call({"op": "admit", "pid": "big", "tokens": 10, "anon": False,
                                  "facts": facts})
            link.send({"op": "finish", "id": go["id"], "context": 10})
            with pytest.raises(FrameTooLarge):
                link.send({"op": "admit", "id": 7, "pid": "huge", "tokens": 10,
                           "anon": False, "facts": {"text": text * 2}})
            after = await link.call({"op": "admit", "pid": "small", "tokens": 10,
                                     "anon": False})
            link.send({"op": "finish", "id": after["id"], "context": 10})
            await asyncio.sleep(0.1)
            closed = link.closed
            await link.close()
            return go["op"], after["op"], str(closed)

        assert lt.call(scenario()) == ("go", "go", "False")
        assert "huge" not in sim.gw.ctl.policy.programs
        lt.call(hub.stop())
    finally:
        lt.close()


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="needs Linux's /proc children list")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_clean_up_alike(sig: signal.Signals, tmp_path: object) -> None:
    """Either signal stops ``mori serve --workers 2`` with its clean-up done: the worker
    stopped, its ``mori-serve-*`` temp folder (the workers' socket) removed, exit 0."""
    tmp = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "mori", "serve", "--port", "0",
                             "--workers", "2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": tmp})
    try:
        url = wait_listening(proc)
        assert [n for n in os.listdir(tmp) if n.startswith("mori-serve-")]
        workers = children(proc.pid)
        assert httpx.get(url + "/healthz").status_code == 200
        proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            stop(proc)
    assert [n for n in os.listdir(tmp) if n.startswith("mori-serve-")] == []
    assert not [w for w in workers if os.path.exists(f"/proc/{w}")]


def test_policy_connections_from_the_environment() -> None:
    """``MORI_POLICY_CONNECTIONS``: unset keeps the default, ``0`` puts every connection
    on a worker, anything but an integer >= 0 is refused saying what it must be."""
    from mori.cli.serve_cmd import POLICY_CONNECTIONS_ENV, policy_connections

    assert policy_connections({}, 2) == 2
    assert policy_connections({POLICY_CONNECTIONS_ENV: "0"}, 2) == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ValueError, match=POLICY_CONNECTIONS_ENV):
            policy_connections({POLICY_CONNECTIONS_ENV: bad}, 2)
    proc = subprocess.run([sys.executable, "-m", "mori", "serve", "--workers", "2"],
                          env={**os.environ, POLICY_CONNECTIONS_ENV: "x"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and POLICY_CONNECTIONS_ENV in proc.stderr
