"""The label channel's server: replies, refusals, coalescing, and a real ZMQ round trip."""

from __future__ import annotations

import json
from typing import Any

import zmq

from mori.plugin_channel import protocol
from mori.plugin_channel.protocol import Message, encode
from mori.plugin_channel.server import LabelServer, label_endpoint

from .conftest import free_port

INFO = {"block_size": 32, "gpu_blocks": 64, "cpu_tier_tokens": 0, "programs": 0}


def server(endpoint: str = "inproc://unused") -> LabelServer:
    return LabelServer(endpoint, lambda: dict(INFO))


def test_hello_and_accepted_ops() -> None:
    s = server()
    r = json.loads(s.handle(encode("hello")))
    assert r == {"v": 1, "op": "hello", "ok": True, "instance": s.instance,
                 "plugin_version": protocol.PLUGIN_VERSION, "auth": "none",
                 "max_frame_bytes": protocol.MAX_FRAME_BYTES,
                 "ops": ["hello", "set", "replace", "drop", "clear"], **INFO}
    assert len(s.instance) == 32 and server().instance != s.instance  # new at every start
    assert json.loads(s.handle(encode("set", labels={"a": "idle"}))) == {
        "v": 1, "op": "set", "ok": True}
    assert json.loads(s.handle(encode("drop", program="b")))["ok"] is True
    assert [m.op for m in s.drain()] == ["drop", "set"]  # drops first: pending.py
    assert s.drain() == []


def test_residency_is_answered_at_once_from_the_callback() -> None:
    held = {"gpu": {"a": 64}, "cpu": {"a": 128, "b": 32}, "inactive": ["b"]}
    s = LabelServer("inproc://unused", lambda: dict(INFO), residency=lambda: held)
    assert "residency" in json.loads(s.handle(encode("hello")))["ops"]
    assert json.loads(s.handle(encode("residency"))) == {"v": 1, "op": "residency",
                                                          "ok": True, **held}
    assert s.drain() == []  # nothing for the scheduler to apply
    # operations the scheduler has not applied yet (an idle engine does not step) count
    s.handle(encode("set", labels={"a": "inactive", "b": "busy"}))
    s.handle(encode("drop", program="c"))
    held["gpu"]["c"] = 16
    r = json.loads(s.handle(encode("residency")))
    assert (r["gpu"], r["inactive"]) == ({"a": 64}, ["a"])
    s.handle(encode("clear"))
    assert json.loads(s.handle(encode("residency")))["inactive"] == []
    bare = server()  # an engine built without the callback refuses it, and says so
    r = json.loads(bare.handle(encode("residency")))
    assert r["ok"] is False and "does not report residency" in r["error"]
    assert bare.rejected == 1


def test_bad_messages_are_refused_not_raised() -> None:
    s = server()
    for frame, op in [(b"\xff\xfe", "error"), (b"[1]", "error"),
                      (encode("frobnicate"), "frobnicate"),
                      (json.dumps({"v": 9, "op": "hello"}).encode(), "hello"),
                      (encode("set", labels={"a": "sleepy"}), "set"),
                      (encode("set", labels=[1]), "set"),
                      (encode("drop"), "drop")]:
        r = json.loads(s.handle(frame))
        assert r["ok"] is False and r["op"] == op and r["error"], (frame, r)
    assert s.rejected == 7 and s.drain() == []


def test_pending_operations_coalesce() -> None:
    s = server()
    s.enqueue(Message("set", labels={"a": "idle"}))
    s.enqueue(Message("set", labels={"a": "busy", "b": "idle"}))
    s.enqueue(Message("drop", program="c"))
    s.enqueue(Message("set", labels={"d": "inactive"}))
    s.enqueue(Message("replace", labels={"e": "idle"}))  # supersedes the sets
    s.enqueue(Message("set", labels={"f": "busy"}))  # merges into the replace
    got = s.drain()
    assert got == [Message("drop", program="c"),
                   Message("replace", labels={"e": "idle", "f": "busy"})]
    # bounded in labels: the least recently set label goes first, as the table would
    small = LabelServer("inproc://x", dict, max_pending_labels=2)
    for p in "abc":
        small.enqueue(Message("drop", program=p))
    assert [m.program for m in small.drain()] == ["b", "c"]
    for p in "abc":
        small.enqueue(Message("set", labels={p: "idle"}))
    small.enqueue(Message("set", labels={"a": "busy"}))
    assert small.pending() == 2
    assert small.drain() == [Message("set", labels={"c": "idle", "a": "busy"})]


def test_endpoint_per_data_parallel_rank() -> None:
    assert label_endpoint(0, {}) == protocol.DEFAULT_LABEL_ENDPOINT
    env = {"MORI_LABEL_ENDPOINT": "tcp://127.0.0.1:6000"}
    assert label_endpoint(0, env) == "tcp://127.0.0.1:6000"
    assert label_endpoint(2, env) == "tcp://127.0.0.1:6002"
    assert label_endpoint(1, {"MORI_LABEL_ENDPOINT": "ipc:///tmp/l"}) == "ipc:///tmp/l-1"
    assert label_endpoint(0, env, configured="tcp://127.0.0.1:7000") == "tcp://127.0.0.1:7000"
    assert label_endpoint(1, env, configured="") == "tcp://127.0.0.1:6001"


def _ask(sock: zmq.Socket[Any], frame: bytes) -> dict[str, Any]:
    sock.send(frame)
    assert sock.poll(5000), "no reply within 5 s"
    return protocol.decode_reply(sock.recv_multipart()[-1])


def test_round_trip_over_zmq_and_clean_close() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    s = server(endpoint)
    assert s.start() and s.running
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoint)
        assert _ask(d, encode("hello"))["gpu_blocks"] == 64
        assert _ask(d, encode("replace", labels={"a": "inactive"}))["ok"] is True
        assert _ask(d, b"not json")["ok"] is False
        assert _ask(d, encode("clear"))["ok"] is True
        assert [m.op for m in s.drain()] == ["clear"]
        # a second server cannot bind the same endpoint: it says so, and does not raise
        other = server(endpoint)
        assert other.start() is False
        d.close(0)
    finally:
        s.close()
        ctx.term()
    assert not s.running
    s.close()  # idempotent
    again = server(endpoint)  # the port is free again
    assert again.start()
    again.close()
