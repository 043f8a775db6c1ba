"""A hostile client against a real ``mori serve``, through raw sockets: each case asserts
the bound, not just that the gateway lived.

- After a 431 (a head over ``--max-header-bytes``) or a 413 (a body over
  ``--max-body-bytes``) the connection is closed and nothing more is read: of 64 MiB the
  client goes on sending, only what the kernel's buffers hold gets out before the
  gateway closes (it read and dropped all of it for two seconds before).
- Malformed HTTP (a raw CR or NUL in a header, a bad, negative or doubled
  ``Content-Length``, ``Content-Length`` with ``Transfer-Encoding``, no HTTP at all) is
  answered 400 in OpenAI's error shape, JSON, and the connection closed: in the policy
  process and, with ``--workers 2``, in a worker.
- A symbolic link planted where the ``--state`` file's temporary file used to be created
  (a predictable name) is not followed: its target is left as it was.
- ``--record-text`` keeps at most ``--record-text-max-bytes`` of one program's text, and
  says where it was cut.
"""

from __future__ import annotations

import gzip
import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mori.gateway.record import TEXT_CUT_MARKER
from support.serve_process import Serve, serve, stop

MiB = 1024 * 1024
PIECE = 64 * 1024


def connect(s: Serve) -> socket.socket:
    sock = socket.create_connection((s.host, s.port), timeout=20)
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the next answer on ``sock``."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {buf!r}"
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers["content-length"])
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of an answer"
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:n]


def closed_within(sock: socket.socket, limit: float) -> bool:
    """Whether the gateway closes ``sock`` within ``limit`` s (what it still sends is
    read: nothing is expected)."""
    deadline = time.monotonic() + limit
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            return False
        try:
            if not sock.recv(65536):
                return True
        except OSError:
            return True
    return False


def push_after_answer(sock: socket.socket, total: int) -> tuple[int, float]:
    """Go on sending ``total`` bytes after the answer, as a client that ignores it would:
    how many got out before the gateway's close stopped them, and in how many seconds."""
    sock.settimeout(15)
    sent = 0
    t0 = time.monotonic()
    try:
        while sent < total:
            sent += sock.send(b"a" * PIECE)
    except OSError:
        pass
    return sent, time.monotonic() - t0


def assert_openai_error(status: int, headers: dict[str, str], body: bytes,
                        want: int) -> dict[str, Any]:
    assert status == want, (status, body)
    assert headers["content-type"].startswith("application/json"), headers
    obj = json.loads(body)
    assert set(obj) == {"error"}
    assert set(obj["error"]) == {"message", "type", "param", "code"}, obj
    assert isinstance(obj["error"]["message"], str) and obj["error"]["message"]
    return dict(obj["error"])


@pytest.fixture(scope="module")
def small() -> Iterator[Serve]:
    s = serve("--max-header-bytes", "8192", "--max-body-bytes", "65536")
    try:
        yield s
    finally:
        stop(s.proc)


@pytest.mark.parametrize("kind", ["431", "413"])
def test_after_a_431_or_413_the_connection_is_closed_and_nothing_more_is_read(
        small: Serve, kind: str) -> None:
    total = 64 * MiB
    sock = connect(small)
    try:
        if kind == "431":
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 16384)
        else:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                         b"content-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % (total + 1))
        status, headers, _ = read_answer(sock)
        assert status == int(kind)
        assert headers["connection"] == "close"
        sent, took = push_after_answer(sock, total)
        # only the kernel's buffers (a few MiB) took anything: the gateway read none of it
        assert sent < 24 * MiB, f"{sent} bytes went out after the {kind}"
        assert took < 10, f"the connection stayed open {took:.1f} s after the {kind}"
    finally:
        sock.close()
    assert httpx.get(small.url + "/healthz").status_code == 200


MALFORMED = {
    "raw CR in a header": b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: b\rc\r\n\r\n",
    "NUL in a header": b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: b\x00c\r\n\r\n",
    "bad Content-Length": b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                          b"content-length: 12x\r\n\r\n{}",
    "negative Content-Length": b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                               b"content-length: -1\r\n\r\n{}",
    "two Content-Lengths": b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                           b"content-length: 2\r\ncontent-length: 3\r\n\r\n{}",
    "Content-Length and Transfer-Encoding": b"POST /v1/chat/completions HTTP/1.1\r\n"
                                            b"host: x\r\ncontent-length: 5\r\n"
                                            b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    "not HTTP": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
}


def check_malformed(s: Serve, held: int = 0) -> None:
    keep = [connect(s) for _ in range(held)]
    try:
        for case, raw in MALFORMED.items():
            sock = connect(s)
            try:
                sock.sendall(raw)
                status, headers, body = read_answer(sock)
                err = assert_openai_error(status, headers, body, 400)
                assert err["code"] == "invalid_http_request", (case, err)
                assert err["type"] == "invalid_request_error", (case, err)
                assert "malformed HTTP request" in err["message"], (case, err)
                assert closed_within(sock, 5), case
            finally:
                sock.close()
    finally:
        for k in keep:
            k.close()


def test_malformed_http_gets_a_json_400_and_the_connection_closed(small: Serve) -> None:
    check_malformed(small)
    assert httpx.get(small.url + "/healthz").status_code == 200


def test_malformed_http_gets_a_json_400_from_a_worker_too() -> None:
    s = serve("--workers", "2", "--header-timeout", "60")
    try:
        # the policy process serves the first connections itself: hold them, so the
        # malformed ones go to the worker
        check_malformed(s, held=2)
        assert httpx.get(s.url + "/healthz").status_code == 200
    finally:
        stop(s.proc)


def test_a_symlink_planted_for_the_state_files_temporary_is_not_followed(
        tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    state = tmp_path / "state.json"
    s = serve("--state", str(state), "--state-interval", "0.2")
    try:
        # the name the temporary file had (the process id in it), and a likely random one
        (tmp_path / f".state.json.{s.proc.pid}.tmp").symlink_to(victim)
        deadline = time.monotonic() + 20
        first = state.stat().st_mtime_ns if state.exists() else None
        while time.monotonic() < deadline:
            if state.exists() and state.stat().st_mtime_ns != first:
                break
            time.sleep(0.1)
        assert state.exists() and not state.is_symlink()
        assert json.loads(state.read_bytes())["format"] == "mori-gateway-state"
    finally:
        stop(s.proc)
    assert victim.read_bytes() == b"precious"


def test_recorded_text_is_capped_per_program_with_a_marker(tmp_path: Path) -> None:
    record = tmp_path / "rec.jsonl.gz"
    cap = 64 * 1024
    s = serve("--record", str(record), "--record-text", "--record-text-max-bytes", str(cap),
              "--max-body-bytes", str(8 * MiB))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            for i in range(3):  # three steps of 300 kB each, one program
                r = c.post("/v1/chat/completions", json={
                    "model": model, "max_tokens": 2, "program_id": "bomb",
                    "messages": [{"role": "user", "content": f"{i}" + "x" * 300_000}]})
                assert r.status_code == 200, r.text
            assert c.post("/v1/programs/bomb/release", json={}).status_code == 200
    finally:
        stop(s.proc)
    lines = gzip.decompress(record.read_bytes()).splitlines()
    programs = [json.loads(ln) for ln in lines[1:]]
    (bomb,) = [p for p in programs if p.get("name", "").endswith("bomb")]
    texts = [st.get("text", "") for st in bomb["steps"]]
    kept = sum(len(t.encode()) for t in texts)
    assert kept <= cap + len(TEXT_CUT_MARKER) * len(texts), kept
    assert texts[0].endswith(TEXT_CUT_MARKER)
    assert all(t == TEXT_CUT_MARKER for t in texts[1:]), [t[:40] for t in texts[1:]]
