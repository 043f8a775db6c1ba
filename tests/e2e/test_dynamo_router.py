"""``mori dynamo-router`` inside a real NVIDIA Dynamo 1.6.1 fleet, on loopback.

One fleet for the module: Dynamo's frontend, two mocker workers (each its own process,
64 GPU blocks of 16 tokens and a 256-block host tier) registered under a model name the
clients do not ask for, and the MORI router registered as the public model, so every
request goes through it. The venv comes from ``scripts/dynamo_cpu_env.sh`` (cached), the
tokenizer from ``scripts/make_tiny_model.py --no-weights``. No etcd or NATS: file
discovery, the TCP request plane, ZMQ events. Each answer asks for ``engine_data``, where
the router says what it did with the turn (its program, replica, worker, wait, cached
tokens by tier).

``MORI_SKIP_DYNAMO=1`` skips these tests; anything else that goes wrong fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from tests.e2e.conftest import CACHE, SCRIPTS, _install_venv

from bench.dynamo_fleet import DynamoFleet, FleetError, WorkerShape, http_json, words

pytestmark = pytest.mark.e2e

PUBLIC_MODEL = "agent"
SHAPE = WorkerShape(gpu_blocks=64, host_blocks=256, block_size=16, speedup=10.0)
GPU_BLOCKS, BLOCK = SHAPE.gpu_blocks, SHAPE.block_size


def instance(f: DynamoFleet, name: str) -> int:
    wid = f.worker_id(name)
    if wid is None:
        pytest.fail(f"{name} registered no worker:\n{f.tail(name)}", pytrace=False)
    return wid


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoFleet]:
    if os.environ.get("MORI_SKIP_DYNAMO") == "1":
        pytest.skip("MORI_SKIP_DYNAMO=1: the Dynamo tests are skipped")
    t0 = time.monotonic()
    venv = _install_venv("dynamo_cpu_env.sh", "Dynamo 1.6.1")
    tokenizer = CACHE / "tiny-llama-tokenizer"
    made = subprocess.run([str(venv / "bin" / "python"), str(SCRIPTS / "make_tiny_model.py"),
                           str(tokenizer), "--no-weights"], capture_output=True, text=True,
                          timeout=300, check=False)
    if made.returncode != 0:
        pytest.fail(f"building the tokenizer failed:\n{made.stderr[-3000:]}", pytrace=False)
    f = DynamoFleet(venv, tokenizer, tmp_path_factory.mktemp("dynamo"), PUBLIC_MODEL,
                    "mori", SHAPE, ("--hold-timeout", "20", "--startup-wait", "90"))
    try:
        try:
            f.start_fleet(workers=2)
        except FleetError as e:
            pytest.fail(str(e), pytrace=False)
        print(f"Dynamo fleet up in {time.monotonic() - t0:.0f} s (venv included)",
              file=sys.stderr)
        yield f
    finally:
        f.stop()


def turn(f: DynamoFleet, program: str | None, text: str, *, final: bool = False,
         stream: bool = False, max_tokens: int = 8) -> tuple[int, Any]:
    headers = {}
    if program is not None:
        headers["x-dynamo-session-id"] = program
    if final:
        headers["x-dynamo-session-final"] = "true"
    body = {"model": PUBLIC_MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": stream,
            "nvext": {"extra_fields": ["engine_data"]}}
    if not stream:
        return http_json(f.url + "/v1/chat/completions", body, headers)
    req = urllib.request.Request(f.url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return r.status, events
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def mori_report(body: Any) -> dict[str, Any]:
    """What the router said of the turn (``nvext.engine_data.mori``)."""
    assert isinstance(body, dict), body
    report = (body.get("nvext") or {}).get("engine_data", {}).get("mori")
    assert isinstance(report, dict), f"no MORI report in {body}"
    return report


def ok_turn(f: DynamoFleet, program: str, text: str) -> dict[str, Any]:
    status, body = turn(f, program, text)
    assert status == 200, (status, body, f.tail("router"))
    report = mori_report(body)
    assert report["program_id"] == program
    report["usage_cached"] = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
    return report


def test_programs_stay_on_their_replica(fleet: DynamoFleet) -> None:
    """Four programs, three turns each: every turn of a program goes to the worker its
    first went to, and from its second turn the engine serves its prefix from cache."""
    texts = {p: words(200, p) for p in ("pinA", "pinB", "pinC", "pinD")}
    first: dict[str, dict[str, Any]] = {}
    for step in range(3):
        for p in texts:
            texts[p] += " " + words(40, f"{p}s{step}")
            r = ok_turn(fleet, p, texts[p])
            if step == 0:
                first[p] = r
                continue
            assert r["worker_id"] == first[p]["worker_id"], (p, step, r, first[p])
            assert r["replica"] == first[p]["replica"]
            assert r["steps"] == step + 1
            assert r["usage_cached"] >= 160, (p, step, r)  # its prefix, not recomputed
            assert r["cached_tokens"] == r["usage_cached"]
    used = {r["worker_id"] for r in first.values()}
    assert len(used) == 2, f"MORI spreads new programs over both workers: {first}"
    release(fleet, *texts)


def release(f: DynamoFleet, *programs: str) -> None:
    for p in programs:
        status, body = turn(f, p, "done", final=True)
        assert status == 200, (p, status, body)


def test_parked_program_comes_back_from_the_host_tier(fleet: DynamoFleet) -> None:
    """A program MORI parked (demoted to its CPU tier while others ran) comes back on its
    worker, promoted as a reload, with its prefix served from the engine's host tier."""
    parked = words(600, "park")
    r1 = ok_turn(fleet, "parked", parked)
    worker = r1["worker_id"]
    # other programs fill both workers' 1,024-token GPU pools many times over
    for i in range(8):
        ok_turn(fleet, f"filler{i}", words(700, f"fill{i}"))
    r2 = ok_turn(fleet, "parked", parked + " " + words(30, "back"))
    assert r2["worker_id"] == worker, (r1, r2)
    assert r2["reloaded"], f"MORI did not park it on its CPU tier and bring it back: {r2}"
    tiers = r2["tiers"]
    assert tiers is not None and tiers["host"] > 0, f"nothing of it on the host tier: {r2}"
    assert r2["usage_cached"] >= 500, f"its prefix was recomputed: {r2}"
    release(fleet, "parked", *(f"filler{i}" for i in range(8)))


def test_bad_input_gets_clean_errors(fleet: DynamoFleet) -> None:
    status, body = turn(fleet, "too-big", words(GPU_BLOCKS * BLOCK + 50, "big"))
    assert status == 400, (status, body)
    assert "GPU KV cache holds 1024" in json.dumps(body), body
    too_long = "x" * 300
    status, body = turn(fleet, too_long, "hello")
    assert status == 400, (status, body)
    assert "x-dynamo-session-id" in json.dumps(body) and "256" in json.dumps(body), body
    status, events = turn(fleet, too_long, "hello", stream=True)
    assert status == 200 and isinstance(events, list), events
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["code"] == 400, events
    assert "x-dynamo-session-id" in errors[0]["message"], errors
    # the router still serves
    ok_turn(fleet, "after-bad", "hello again")


def test_session_final_frees_the_program(fleet: DynamoFleet) -> None:
    r1 = ok_turn(fleet, "finishing", words(100, "fin"))
    r2 = ok_turn(fleet, "finishing", words(100, "fin") + " more")
    assert r2["steps"] == 2
    status, body = turn(fleet, "finishing", "done", final=True)
    assert status == 200, body
    assert not body.get("choices"), f"session_final was forwarded: {body}"
    # the next request of that session is a new program, and the one before is gone
    r3 = ok_turn(fleet, "finishing", words(100, "fin"))
    assert r3["steps"] == 1, r3
    assert r3["programs"] == r2["programs"], (r2, r3)
    assert r1["program_id"] == r3["program_id"]
    assert "program finishing: session_final, released" in fleet.log("router")


def test_one_off_requests_are_served(fleet: DynamoFleet) -> None:
    status, body = turn(fleet, None, "no session here")
    assert status == 200, body
    assert mori_report(body)["program_id"].startswith("dynamo-one-off-")


def test_killed_workers_programs_are_placed_again(fleet: DynamoFleet) -> None:
    """Kill the worker a program is on: its next turns get clean errors at most, then
    run on the other worker; a new worker takes the free slot."""
    text = words(150, "survivor")
    r1 = ok_turn(fleet, "survivor", text)
    ids = {name: instance(fleet, name) for name in ("worker-a", "worker-b")}
    victim = next(n for n, w in ids.items() if w == r1["worker_id"])
    other = next(w for n, w in ids.items() if n != victim)
    fleet.kill(victim)
    deadline = time.monotonic() + 30
    while True:
        status, body = turn(fleet, "survivor", text + " next")
        if status == 200:
            break
        assert status in (500, 502, 503), (status, body)
        assert isinstance(body, dict) and body.get("message"), body
        assert time.monotonic() < deadline, f"never re-placed:\n{fleet.tail('router')}"
        time.sleep(0.5)
    r2 = mori_report(body)
    assert r2["worker_id"] == other, (r1, r2)
    assert r2["replica"] != r1["replica"] or r2["worker_id"] != r1["worker_id"]
    # a new worker joins into the free slot and gets new programs again
    fleet.start_worker("worker-c")
    new_id = instance(fleet, "worker-c")
    deadline = time.monotonic() + 30
    seen: set[int] = set()
    i = 0
    while new_id not in seen:
        assert time.monotonic() < deadline, (seen, new_id, fleet.tail("router"))
        seen.add(ok_turn(fleet, f"late{i}", words(50, f"late{i}"))["worker_id"])
        i += 1
        time.sleep(0.2)
