"""``--state FILE``: idleness histories kept across a gateway restart.

The file on its own (atomic writes, torn and foreign files refused with the file named),
then a gateway in front of a simulated engine (which reports residency) stopped and
started again: with the state file, a restored program keeps the idleness it had; without
it, every restored program reads as fully idle as soon as time passes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import httpx
import pytest

from mori.core.idleness import IdlenessHistory
from mori.engines.simulated import SimEngineAdapter
from mori.enginesim import EngineSimConfig, start_engine_sim
from mori.gateway.app import create_app
from mori.gateway.config import GatewaySettings
from mori.gateway.state import (
    SavedState,
    StateError,
    StateKeeper,
    check_state_path,
    encode,
    load_state,
    read_state,
    write_state,
)
from support.loop_thread import LoopThread

H = {"a": IdlenessHistory(((1.0, 3.0), (0.5, 0.5)), 2.0, 4.0), "b": IdlenessHistory()}


def test_a_state_file_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, encode(H.items(), 1000.0))
    assert read_state(path) == SavedState(1000.0, H)
    write_state(path, encode([("c", IdlenessHistory())], 1001.0))
    assert read_state(path).histories == {"c": IdlenessHistory()}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left
    # a tool call in progress went on while the gateway was down; a cut step did not
    aged = read_state(path).aged(1011.0, time_scale=2.0)
    assert aged == {"c": IdlenessHistory()}
    assert SavedState(1000.0, H).aged(1010.0)["a"] == IdlenessHistory(H["a"].cycles, 2.0, 14.0)


def test_a_planted_symlink_is_never_followed(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Links planted at the temporary names the gateway draws (the old predictable one,
    and the first random one) and at the state file itself: no target is written."""
    import os

    import mori.gateway.state as state_mod

    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    path = tmp_path / "state.json"
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(state_mod.secrets, "token_hex", lambda n: next(names))
    for name in (f".state.json.{os.getpid()}.tmp", ".state.json.planted.tmp"):
        (tmp_path / name).symlink_to(target)
    write_state(path, encode(H.items(), 1000.0))
    assert target.read_bytes() == b"precious"
    assert read_state(path) == SavedState(1000.0, H)
    assert not (tmp_path / ".state.json.fresh.tmp").exists()  # renamed over the file
    assert (tmp_path / ".state.json.planted.tmp").is_symlink()  # left as it was
    # the state file itself a link: the link is replaced, its target untouched
    path.unlink()
    path.symlink_to(target)
    monkeypatch.setattr(state_mod.secrets, "token_hex", lambda n: "again")
    write_state(path, encode(H.items(), 1001.0))
    assert target.read_bytes() == b"precious"
    assert not path.is_symlink() and read_state(path).written_at == 1001.0


@pytest.mark.parametrize("content, fault", [
    (b'{"format": "mori-gateway-state", "version": 1, "written_at": 1, "progr', "not JSON"),
    (b'{"traceEvents": []}', "not a MORI gateway state file"),
    (b'{"format": "mori-gateway-state", "version": 7, "written_at": 1, "programs": {}}',
     "state version 7"),
    (b'{"format": "mori-gateway-state", "version": 1, "written_at": 1, '
     b'"programs": {"p": [[[1, -2]], 0, 0]}}', "program 'p'"),
    (b'{"format": "mori-gateway-state", "version": 1, "programs": {}}', "'written_at'"),
    (b'{"format": "mori-gateway-state", "version": 1, "written_at": 1, '
     b'"programs": {"p": [[[1, 2, 3]], 0, 0]}}', r"a cycle is \[reasoning_s, acting_s\]"),
    (b'{"format": "mori-gateway-state", "version": 1, "written_at": 1, "programs": {"p": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}}", "nested too deeply"),
])
def test_an_unusable_state_file_names_the_file_and_the_fault(
        tmp_path: Path, content: bytes, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(StateError, match=fault) as e:
        read_state(path)
    assert str(path) in str(e.value)
    with caplog.at_level(logging.WARNING, logger="mori.gateway"):
        assert load_state(path) is None  # a starting gateway goes on without it
    assert any("--state: ignored" in r.getMessage() and str(path) in r.getMessage()
               for r in caplog.records)


def test_a_state_path_that_cannot_be_written_is_refused_before_start(tmp_path: Path) -> None:
    check_state_path(tmp_path / "new.json")  # a new file in a writable folder: fine
    with pytest.raises(StateError, match="does not exist"):
        check_state_path(tmp_path / "missing" / "state.json")
    with pytest.raises(StateError, match="not a file"):
        check_state_path(tmp_path)
    assert load_state(tmp_path / "new.json") is None  # none yet: no history, no error


def test_the_keeper_writes_on_its_interval_and_at_stop(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    rows = [("a", H["a"])]

    async def go() -> int:
        keeper = StateKeeper(path, 0.05, lambda: list(rows))
        keeper.start()
        await asyncio.sleep(0.3)
        rows.append(("b", H["b"]))
        await keeper.stop()
        return keeper.writes
    writes = asyncio.run(go())
    assert writes >= 3
    assert read_state(path).histories == H  # the last snapshot is the one at stop


# -- a gateway restarted with and without its state file -------------------------------------

def ask(url: str, pid: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "Qwen3-30B-A3B", "max_tokens": 2, "program_id": pid,
        "messages": [{"role": "user", "content": f"{pid}: " + "step " * 50}]})
    assert r.status_code == 200, r.text


def idleness(url: str, pid: str) -> float:
    r = httpx.get(f"{url}/v1/programs/{pid}", timeout=10)
    assert r.status_code == 200, r.text
    return float(r.json()["idleness"])


def test_restored_programs_keep_their_idleness_with_the_state_file(
        loop_thread: LoopThread, tmp_path: Path) -> None:
    lt = loop_thread
    srv = lt.call(start_engine_sim(EngineSimConfig("h200-qwen3-30b-a3b", time_scale=50)))
    lt.handles.append(srv)
    state = tmp_path / "state.json"

    def gateway(with_state: bool) -> tuple[str, object]:
        settings = GatewaySettings(state=str(state) if with_state else None,
                                   state_interval_s=60.0)
        running = lt.serve(create_app(settings, [SimEngineAdapter(srv.url)]))
        return running.url, running

    url, first = gateway(True)
    for _ in range(3):  # "busy" runs back to back; "slow" spends most of its time in tools
        ask(url, "busy")
        ask(url, "slow")
        time.sleep(0.4)
        ask(url, "busy")
    time.sleep(0.2)
    before = {pid: idleness(url, pid) for pid in ("busy", "slow")}
    lt.call(first.stop())  # the last snapshot is written at shutdown
    saved = json.loads(state.read_text())["programs"]
    assert set(saved) == {"busy", "slow"}

    url, second = gateway(True)
    after = {pid: idleness(url, pid) for pid in ("busy", "slow")}
    # the same ranks as before the restart, a little idler for the time that passed
    assert after["busy"] < after["slow"] < 1.0, (before, after)
    for pid in before:
        assert before[pid] - 0.01 <= after[pid] <= before[pid] + 0.2, (pid, before, after)
    lt.call(second.stop())

    url, third = gateway(False)  # without the file: no history, fully idle at once
    time.sleep(0.05)
    assert {pid: idleness(url, pid) for pid in ("busy", "slow")} == {"busy": 1.0, "slow": 1.0}
    lt.call(third.stop())
