"""A hostile peer on the label channel: the engine's server (``mori.plugin_channel``) with
a secret, and the gateway's ``LabelChannel``, over real ZMQ sockets on loopback.

Each case asserts the bound: a peer without the secret (unsigned, badly signed, replayed,
off the clock) gets one bare refusal and changes nothing the gateway can read back; a
frame over the limit never reaches the server; a flood leaves at most the table's size
pending and pushes out none of the gateway's own operations; an endpoint others can reach
is refused without a secret.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from mori.engines.label_channel import LabelChannel, LabelChannelDown
from mori.engines.registry import parse_backend, with_label_secret
from mori.plugin_channel import auth, protocol
from mori.plugin_channel.auth import (
    ExposureError,
    LabelSecret,
    ReplayGuard,
    SecretError,
    check_exposure,
    is_local_endpoint,
)
from mori.plugin_channel.protocol import Message, encode
from mori.plugin_channel.server import LabelServer, configured_server
from support.fake_plugin import free_port

KEY = "k" * 16 + "0123456789abcdef0123456789abcdef"
OTHER = "o" * 48
INFO = {"block_size": 32, "gpu_blocks": 64, "cpu_tier_tokens": 0, "programs": 0}
REFUSAL_KEYS = {"v", "op", "ok", "error"}


def secret_file(tmp: Path, *keys: str, name: str = "label.key") -> Path:
    p = tmp / name
    p.write_text("".join(k + "\n" for k in keys))
    p.chmod(0o600)
    return p


class Engine:
    """A label server with a secret and a residency that reports its pending labels."""

    def __init__(self, secret: LabelSecret | None, **kw: Any) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.server = LabelServer(self.endpoint, lambda: dict(INFO), secret=secret,
                                  residency=lambda: {"gpu": {}, "cpu": {}, "inactive": []},
                                  **kw)
        assert self.server.start()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = Engine(LabelSecret.from_file(secret_file(tmp_path, KEY)))
    yield e
    e.server.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(0)


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    return d


def ask(sock: zmq.Socket[bytes], *frames: bytes, wait_ms: int = 5000) -> list[bytes] | None:
    sock.send_multipart(list(frames))
    if not sock.poll(wait_ms):
        return None
    return sock.recv_multipart()


def signed(secret: LabelSecret, op: str, ts: float | None = None, nonce: str | None = None,
           **fields: Any) -> tuple[bytes, bytes]:
    frame = encode(op, **fields, ts=time.time() if ts is None else ts,
                   nonce=nonce or auth.new_nonce())
    return frame, secret.sign_request(frame)


def is_bare_refusal(parts: list[bytes] | None) -> str:
    """The refusal's error, after checking it carries nothing else."""
    assert parts is not None and len(parts) == 1, parts
    r = json.loads(parts[0])
    assert set(r) == REFUSAL_KEYS and r["ok"] is False and r["op"] == "refused", r
    assert r["error"].startswith("unauthenticated: "), r
    return str(r["error"])


def read_back(endpoint: str, secret: LabelSecret) -> dict[str, Any]:
    """What the engine says through an authenticated gateway channel."""
    async def go() -> dict[str, Any]:
        ch = LabelChannel(endpoint, 5.0, secret=secret)
        try:
            return {"hello": await ch.hello(), "residency": await ch.residency()}
        finally:
            await ch.close()
    return asyncio.run(go())


# -- a peer without the secret -----------------------------------------------------------


def test_an_unsigned_peer_gets_a_bare_refusal_and_changes_nothing(
        engine: Engine, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    secret = LabelSecret.from_file(tmp_path / "label.key")
    frame, tag = signed(secret, "set", labels={"mine": "inactive"})
    gw = dealer(ctx, engine.endpoint)
    assert json.loads((ask(gw, frame, tag) or [b""])[0])["ok"] is True
    intruder = dealer(ctx, engine.endpoint)
    caplog.set_level(logging.WARNING, "mori.plugin_channel.server")
    for op, fields in [("hello", {}), ("residency", {}), ("drop", {"program": "mine"}),
                       ("clear", {}), ("replace", {"labels": {"x": "busy"}}),
                       ("set", {"labels": {"mine": "busy", "y": "inactive"}})]:
        why = is_bare_refusal(ask(intruder, encode(op, **fields)))
        assert "unsigned" in why
    # with a made-up signature, or the wrong key, or in three frames: the same
    bad = LabelSecret([OTHER.encode()])
    f2, t2 = signed(bad, "drop", program="mine")
    assert "bad signature" in is_bare_refusal(ask(intruder, f2, t2))
    assert "bad signature" in is_bare_refusal(ask(intruder, f2, b"\0" * 32))
    is_bare_refusal(ask(intruder, f2, t2, b"x"))
    assert engine.server.unauthenticated == 9
    assert engine.server.drain() == [Message("set", labels={"mine": "inactive"})]
    # logged, and at most a line per reason every 10 s
    lines = [r.getMessage() for r in caplog.records if "ignored a message" in r.getMessage()]
    assert 1 <= len(lines) <= 3 and any("unsigned" in ln for ln in lines), lines
    assert any("127.0.0.1" in ln for ln in lines), lines  # from where


def test_what_an_intruder_sends_is_not_read_back(engine: Engine,
                                                 ctx: zmq.Context[zmq.Socket[bytes]],
                                                 tmp_path: Path) -> None:
    secret = LabelSecret.from_file(tmp_path / "label.key")

    async def label() -> None:
        ch = LabelChannel(engine.endpoint, 5.0, secret=secret)
        await ch.hello()
        await ch.set_many({"a": "inactive", "b": "idle"})
        await ch.close()
    asyncio.run(label())
    intruder = dealer(ctx, engine.endpoint)
    for op, fields in [("clear", {}), ("drop", {"program": "a"}),
                       ("set", {"labels": {"a": "busy", "z": "inactive"}})]:
        is_bare_refusal(ask(intruder, encode(op, **fields)))
    got = read_back(engine.endpoint, secret)
    assert got["residency"]["inactive"] == ["a"]
    assert got["hello"]["auth"] == "hmac-sha256"


def test_a_replayed_or_stale_message_is_refused(engine: Engine,
                                                ctx: zmq.Context[zmq.Socket[bytes]],
                                                tmp_path: Path) -> None:
    secret = LabelSecret.from_file(tmp_path / "label.key")
    gw = dealer(ctx, engine.endpoint)
    frame, tag = signed(secret, "drop", program="victim")
    first = ask(gw, frame, tag)
    assert first is not None and len(first) == 2 and json.loads(first[0])["ok"] is True
    assert secret.verify_reply(tag, first[0], first[1])  # bound to its request
    assert not secret.verify_reply(b"\1" * 32, first[0], first[1])
    engine.server.drain()
    intruder = dealer(ctx, engine.endpoint)  # replays what it captured
    assert "replayed" in is_bare_refusal(ask(intruder, frame, tag))
    old, old_tag = signed(secret, "clear", ts=time.time() - 3600)
    assert "synchronise the clocks" in is_bare_refusal(ask(intruder, old, old_tag))
    no_nonce = encode("clear", ts=time.time())
    assert "nonce" in is_bare_refusal(ask(intruder, no_nonce, secret.sign_request(no_nonce)))
    assert engine.server.drain() == []


def test_replay_guard_forgets_only_what_has_expired() -> None:
    g = ReplayGuard(window_s=30, max_nonces=3)
    now = 1000.0
    assert g.check(now, "n" * 16, now) is None
    assert g.check(now, "n" * 16, now + 10) is not None  # replayed
    assert g.check(now + 1, "m" * 16, now + 1) is None
    assert g.check(now + 1, "o" * 16, now + 1) is None
    assert "refused until older ones expire" in str(g.check(now + 2, "p" * 16, now + 2))
    assert len(g) == 3  # bounded
    assert g.check(now + 61, "q" * 16, now + 61) is None  # the first expired: room again
    assert g.check(now + 62, "n" * 16, now + 62) is None  # and its nonce may come back


def test_a_frame_over_the_limit_never_reaches_the_server(
        tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    secret = LabelSecret.from_file(secret_file(tmp_path, KEY))
    e = Engine(secret, max_frame_bytes=64 * 1024)
    try:
        intruder = dealer(ctx, e.endpoint)
        intruder.send(b"x" * (64 * 1024 + 1))  # ZMQ drops the peer on the frame's header
        huge = dealer(ctx, e.endpoint)
        huge.send(b"{" * (8 << 20))
        time.sleep(0.5)
        assert intruder.poll(200) == 0 and huge.poll(200) == 0  # no answer
        assert e.server.received == 0  # nothing was handed to the server
        got = read_back(e.endpoint, secret)  # the gateway is still served
        assert got["hello"]["max_frame_bytes"] == 64 * 1024
        assert e.server.received == 2
    finally:
        e.server.close()


# -- bounded in labels -----------------------------------------------------------------------


def test_a_flood_of_sets_stays_within_the_label_bound(tmp_path: Path) -> None:
    """600 ``set`` messages of 1,000 new ids (what merged into 600,000 pending labels):
    at most ``max_pending_labels`` wait, the newest, and the gateway's own drop stays."""
    secret = LabelSecret.from_file(secret_file(tmp_path, KEY))
    s = LabelServer("inproc://flood", dict, secret=secret, max_pending_labels=5_000)
    f, t = signed(secret, "drop", program="gateway-drop")
    assert json.loads(s.handle_frames([f, t])[0])["ok"] is True
    for i in range(600):
        labels = {f"p{i}-{j}": "idle" for j in range(1_000)}
        f, t = signed(secret, "set", labels=labels)
        assert json.loads(s.handle_frames([f, t])[0])["ok"] is True
    assert s.pending() == 5_000 + 1
    got = s.drain()
    assert got[0] == Message("drop", program="gateway-drop")
    assert len(got) == 2 and got[1].op == "set" and len(got[1].labels or {}) == 5_000
    assert "p599-999" in (got[1].labels or {}) and "p0-0" not in (got[1].labels or {})


def test_drops_and_sets_do_not_push_each_other_out() -> None:
    s = LabelServer("inproc://drops", dict, max_pending_labels=100)
    s.enqueue(Message("set", labels={"gw": "inactive"}))
    for i in range(30_000):  # what pushed out every older pending op
        s.enqueue(Message("drop", program=f"d{i}"))
    s.enqueue(Message("set", labels={"gw2": "idle"}))
    assert s.pending() == 100 + 2
    got = s.drain()
    assert got[-1] == Message("set", labels={"gw": "inactive", "gw2": "idle"})
    assert [m.program for m in got[:-1]] == [f"d{i}" for i in range(29_900, 30_000)]


def test_unauthenticated_floods_leave_no_pending_work(engine: Engine,
                                                      ctx: zmq.Context[zmq.Socket[bytes]],
                                                      tmp_path: Path) -> None:
    secret = LabelSecret.from_file(tmp_path / "label.key")
    f, t = signed(secret, "set", labels={"gw": "inactive"})
    gw = dealer(ctx, engine.endpoint)
    assert json.loads((ask(gw, f, t) or [b""])[0])["ok"] is True
    intruder = dealer(ctx, engine.endpoint)
    n, batch = 3_000, 20  # read each batch's refusals before the next: the engine's
    # ROUTER drops replies past its send high-water mark per peer (SNDHWM, 64), as for a
    # peer that reads nothing, and ZMQ acknowledges reads to the sender only every half
    # of that (32), so a batch must stay under 64 - 32 (batches of 200, and of 50, lost
    # replies now and then)
    for start in range(0, n, batch):
        for i in range(start, start + batch):
            intruder.send(encode("drop", program=f"d{i}"))
        for _ in range(batch):
            assert intruder.poll(10_000), "a refusal did not come"
            intruder.recv()
    assert engine.server.unauthenticated == n
    assert engine.server.drain() == [Message("set", labels={"gw": "inactive"})]


# -- the gateway's end -------------------------------------------------------------------------


def test_the_gateway_says_why_a_secret_does_not_match(tmp_path: Path) -> None:
    keyed = Engine(LabelSecret.from_file(secret_file(tmp_path, KEY)))
    plain = Engine(None)

    async def down(endpoint: str, secret: LabelSecret | None) -> str:
        ch = LabelChannel(endpoint, 3.0, secret=secret)
        try:
            with pytest.raises(LabelChannelDown) as e:
                await ch.hello()
            return str(e.value)
        finally:
            await ch.close()
    try:
        wrong = LabelSecret([OTHER.encode()], source="file wrong.key")
        assert "must be one of the engine's keys" in asyncio.run(down(keyed.endpoint, wrong))
        assert "label_secret_file=" in asyncio.run(down(keyed.endpoint, None))
        assert "not signed" in asyncio.run(down(plain.endpoint, wrong))
        assert keyed.server.drain() == [] and plain.server.drain() == []
    finally:
        keyed.server.close()
        plain.server.close()


def test_a_table_larger_than_a_frame_goes_in_pieces(tmp_path: Path) -> None:
    secret = LabelSecret.from_file(secret_file(tmp_path, KEY))
    e = Engine(secret, max_frame_bytes=8192)
    table = {f"program-{i:05d}": "idle" for i in range(2_000)}  # ~50 KB of JSON

    async def go() -> None:
        ch = LabelChannel(e.endpoint, 5.0, secret=secret)
        await ch.hello()
        assert ch.max_frame_bytes == 8192
        await ch.replace(table)
        await ch.close()
    try:
        asyncio.run(go())
        got = e.server.drain()
        assert got == [Message("replace", labels=table)]
        assert e.server.received > 2 + 5  # hello, and several pieces
    finally:
        e.server.close()


def test_rotating_the_secret_needs_no_restart(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "RELOAD_EVERY_S", 0.0)
    new = "n" * 64
    engine_file = secret_file(tmp_path, KEY, name="engine.key")
    e = Engine(LabelSecret.from_file(engine_file))
    old_gw = LabelSecret.from_file(secret_file(tmp_path, KEY, name="old.key"))
    new_gw = LabelSecret.from_file(secret_file(tmp_path, new, name="new.key"))
    try:
        with pytest.raises(LabelChannelDown):
            read_back(e.endpoint, new_gw)
        secret_file(tmp_path, KEY, new, name="engine.key")  # 1. the engines take both
        os.utime(engine_file, (time.time() + 5, time.time() + 5))
        assert read_back(e.endpoint, new_gw)["hello"]["ok"]  # 2. the gateway moves
        assert read_back(e.endpoint, old_gw)["hello"]["ok"]
        secret_file(tmp_path, new, name="engine.key")  # 3. the old key goes
        os.utime(engine_file, (time.time() + 10, time.time() + 10))
        with pytest.raises(LabelChannelDown):
            read_back(e.endpoint, old_gw)
        assert read_back(e.endpoint, new_gw)["hello"]["ok"]
    finally:
        e.server.close()


# -- where a secret is needed, and where it comes from ----------------------------------------


@pytest.mark.parametrize("endpoint,local", [
    ("tcp://127.0.0.1:5558", True), ("tcp://localhost:5558", True),
    ("tcp://[::1]:5558", True), ("ipc:///tmp/mori-labels", True), ("inproc://x", True),
    ("tcp://*:5558", False), ("tcp://0.0.0.0:5558", False), ("tcp://10.1.2.3:5558", False),
    ("tcp://[::]:5558", False), ("tcp://eth0:5558", False)])
def test_which_endpoints_go_without_a_secret(endpoint: str, local: bool) -> None:
    assert is_local_endpoint(endpoint) is local
    if local:
        check_exposure(endpoint, None, side="engine")
        return
    with pytest.raises(ExposureError, match="--label-secret-file"):
        LabelServer(endpoint, dict)
    with pytest.raises(ExposureError, match="label_secret_file="):
        LabelChannel(endpoint)
    LabelServer(endpoint, dict, secret=LabelSecret([KEY.encode()]))  # with one: fine


def test_the_engine_reads_its_secret_from_config_or_environment(tmp_path: Path) -> None:
    path = secret_file(tmp_path, KEY)
    open_bind = {"mori_label_endpoint": "tcp://0.0.0.0:5558"}
    with pytest.raises(ExposureError, match="refusing to bind tcp://0.0.0.0:5558"):
        configured_server(dict, config=open_bind, env={})
    s = configured_server(dict, config={**open_bind, "mori_label_secret_file": str(path)},
                          env={})
    assert s.secret is not None and s.secret.keys() == [KEY.encode()]
    s = configured_server(dict, config=open_bind, env={"MORI_LABEL_SECRET_FILE": str(path)})
    assert s.secret is not None
    s = configured_server(dict, config=open_bind, env={"MORI_LABEL_SECRET": KEY})
    assert s.secret is not None and s.endpoint == "tcp://0.0.0.0:5558"
    with pytest.raises(SecretError, match="openssl rand -hex 32"):
        configured_server(dict, config={"mori_label_secret_file": str(tmp_path / "none")},
                          env={})
    with pytest.raises(SecretError, match="shorter than 32"):
        configured_server(dict, env={"MORI_LABEL_SECRET": "hunter2"})
    with pytest.raises(SecretError, match="holds no key"):
        LabelSecret.from_file(secret_file(tmp_path, "# only a comment", name="empty.key"))


def test_a_readable_secret_file_is_warned_about(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = secret_file(tmp_path, KEY)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        LabelSecret.from_file(path)
    assert "chmod 600" in caplog.text


def test_the_backend_spec_and_serve_default_carry_the_secret_file(tmp_path: Path) -> None:
    path = secret_file(tmp_path, KEY)
    spec = "vllm=http://10.0.0.5:8000,labels=tcp://10.0.0.5:5558"
    with pytest.raises(ExposureError):
        parse_backend(spec).build()
    adapter: Any = parse_backend(f"{spec},label_secret_file={path}").build()
    assert adapter.link.channel.secret.keys() == [KEY.encode()]
    assert with_label_secret(spec, str(path)) == f"{spec},label_secret_file={path}"
    own = f"{spec},label_secret_file=/other"
    assert with_label_secret(own, str(path)) == own  # a backend's own file wins
    plain = "vllm=http://10.0.0.5:8000"
    assert with_label_secret(plain, str(path)) == plain  # no label channel: nothing
    assert with_label_secret("sglang=http://h:1,labels=tcp://h:2", "/k").endswith(
        ",label_secret_file=/k")


def test_protocol_constants_are_the_servers() -> None:
    assert LabelServer("inproc://c", dict).max_frame_bytes == protocol.MAX_FRAME_BYTES
