"""Bounds on every connection (``mori.gateway.bounds``), through ``mori serve`` processes
and raw sockets: a huge request head is answered 431 before it is read (and ``/healthz``
stays fast meanwhile); idle, slow-head and stalled-body connections are closed after
their timeouts (a body that keeps coming is not); a body over the limit is refused
before it is read, on every route; the connection cap closes idle connections so a
genuine client is still served (also under a small descriptor limit), says so once in
the log, and answers 503 when every connection is busy; and with ``--workers`` the
routes passed on to the policy process check keys and the body limit before reading."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from mori.engines.http import parse_prometheus
from support.serve_process import Serve, serve, stop

KEY = "sk-bounds-test-key"
ADMIN = "sk-bounds-test-admin"
PIECE = 64 * 1024


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error object of the body."""
        obj = json.loads(self.body)
        assert set(obj) == {"error"} and {"message", "type", "code"} <= set(obj["error"])
        return dict(obj["error"])


def connect(s: Serve, sndbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if sndbuf is not None:  # a small buffer: what was sent is close to what was read
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.settimeout(20)
    sock.connect((s.host, s.port))
    return sock


def read_answer(sock: socket.socket, timeout: float = 20.0) -> Answer | None:
    """The next answer on ``sock`` (None: closed without one)."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            chunk = b""
        if not chunk:
            assert not buf, f"the connection closed in the middle of an answer: {buf!r}"
            return None
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip()
               for k, v in (ln.split(":", 1) for ln in lines[1:])}
    n = int(headers.get("content-length", "0"))
    while len(rest) < n:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed in the middle of an answer's body"
        rest += chunk
    return Answer(int(lines[0].split()[1]), headers, rest[:n])


def closed_after(sock: socket.socket, limit: float = 20.0) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping what it answers)."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    while True:
        try:
            if not sock.recv(65536):
                return time.monotonic() - t0
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        except TimeoutError:
            raise AssertionError(f"the connection stayed open for {limit:g} s") from None


def readable(sock: socket.socket, timeout: float = 0.0) -> bool:
    """Whether ``sock`` has something to read (or is closed), within ``timeout`` s (poll,
    not select: the tests open many sockets)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return bool(p.poll(timeout * 1000))


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (without waiting)."""
    if not readable(sock):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def send_until_answered(sock: socket.socket, head: bytes, pieces: Iterator[bytes]
                        ) -> tuple[int, Answer | None]:
    """Send ``head``, then ``pieces`` one by one until an answer is there; the bytes of
    ``pieces`` sent by then, and the answer."""
    sock.sendall(head)
    sent = 0
    for piece in pieces:
        if readable(sock):
            break
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            break
        sent += len(piece)
    return sent, read_answer(sock)


def zeros(total: int) -> Iterator[bytes]:
    for _ in range(total // PIECE):
        yield b"0" * PIECE


def chunked(total: int) -> Iterator[bytes]:
    for piece in zeros(total):
        yield b"%x\r\n" % len(piece) + piece + b"\r\n"


def post_head(path: str, extra: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
            f"{extra}\r\n").encode()


def chat_body(model: str) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, "mori": {"prompt_tokens": 50}}).encode()


def healthz_worst(url: str, stop_when: Callable[[], bool]) -> float:
    """The slowest ``/healthz`` of those asked one after another until ``stop_when``."""
    worst = 0.0
    with httpx.Client(timeout=30) as c:
        while not stop_when():
            t0 = time.monotonic()
            assert c.get(url + "/healthz").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
    return worst


@pytest.fixture(scope="module")
def small() -> Iterator[Serve]:
    """One process with small bounds, so the tests are fast."""
    s = serve("--max-header-bytes", "8192", "--header-timeout", "1", "--body-timeout", "1",
              "--keep-alive-timeout", "1", "--max-body-bytes", "65536")
    try:
        yield s
    finally:
        stop(s.proc)


def test_a_huge_head_is_answered_431_before_it_is_read_and_healthz_stays_fast(
        small: Serve) -> None:
    total = 16 * 1024 * 1024
    done = threading.Event()
    with ThreadPoolExecutor(1) as ex:
        worst = ex.submit(healthz_worst, small.url, done.is_set)
        sock = connect(small, sndbuf=PIECE)
        try:
            sent, ans = send_until_answered(
                sock, b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-big: ",
                (b"a" * PIECE for _ in range(total // PIECE)))
        finally:
            done.set()
            sock.close()
        assert ans is not None and ans.status == 431
        assert ans.error()["code"] == "request_header_fields_too_large"
        assert ans.headers["connection"] == "close"
        assert sent < total // 4, f"{sent} bytes of the head were sent before the answer"
        assert worst.result() < 1.0  # generous: it was seconds while a huge head uploaded
    # a head within the limit is served, big headers and all
    r = httpx.get(small.url + "/healthz", headers={"x-big": "a" * 6000})
    assert r.status_code == 200


def test_a_huge_trailer_after_a_chunked_body_is_refused_like_a_huge_head(small: Serve
                                                                        ) -> None:
    total = 16 * 1024 * 1024
    sock = connect(small, sndbuf=PIECE)
    try:
        sent, ans = send_until_answered(
            sock, post_head("/v1/chat/completions", "transfer-encoding: chunked\r\n")
            + b"5\r\n{\"a\":\r\n0\r\nx-trailer: ", (b"a" * PIECE for _ in range(total // PIECE)))
        assert ans is not None and ans.status == 431, ans
        assert sent < total // 4, sent
    finally:
        sock.close()


def test_idle_and_slow_head_connections_are_closed_after_their_timeouts(small: Serve
                                                                        ) -> None:
    idle = connect(small)  # never sends a byte
    opened = time.monotonic()
    slow = connect(small)  # slowloris: a header line now and then, never the end
    slow.sendall(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n")
    kept = connect(small)  # keep-alive after one answer
    kept.sendall(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
    first = read_answer(kept)
    assert first is not None and first.status == 200
    t0 = time.monotonic()
    answer: list[Answer | None] = []

    def trickle() -> None:
        try:
            while time.monotonic() - t0 < 10:
                slow.sendall(b"x-a: b\r\n")
                if readable(slow, 0.2):
                    break
        except OSError:
            pass
        answer.append(read_answer(slow))

    th = threading.Thread(target=trickle)
    th.start()
    try:
        closed_after(idle)
        assert 0.9 <= time.monotonic() - opened < 10  # the header timeout is 1 s
        assert closed_after(kept) < 10
        th.join(20)
        assert answer and answer[0] is not None and answer[0].status == 408
        assert answer[0].error()["code"] == "header_timeout"
        assert time.monotonic() - t0 < 10  # the trickle went on for 10 s otherwise
    finally:
        for s in (idle, slow, kept):
            s.close()


def test_stalled_bodies_get_408_and_are_closed(small: Serve) -> None:
    short = connect(small)  # a body shorter than its Content-Length
    short.sendall(post_head("/v1/chat/completions", "content-length: 100\r\n") + b'{"mod')
    endless = connect(small)  # a chunked body that never ends
    endless.sendall(post_head("/v1/chat/completions", "transfer-encoding: chunked\r\n")
                    + b"5\r\n{\"mod\r\n")
    try:
        for sock in (short, endless):
            ans = read_answer(sock)
            assert ans is not None and ans.status == 408, ans
            assert ans.error()["code"] == "body_timeout"
            assert closed_after(sock) < 10
    finally:
        short.close()
        endless.close()


def test_a_body_that_keeps_coming_is_not_cut_off(small: Serve) -> None:
    model = httpx.get(small.url + "/v1/models").json()["data"][0]["id"]
    body = chat_body(model)
    sock = connect(small)
    try:
        sock.sendall(post_head("/v1/chat/completions", "transfer-encoding: chunked\r\n"))
        t0 = time.monotonic()
        for i in range(0, len(body), 8):  # a piece every 0.25 s: longer than the timeout
            piece = body[i:i + 8]
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            time.sleep(0.25)
        sock.sendall(b"0\r\n\r\n")
        assert time.monotonic() - t0 > 1.5
        ans = read_answer(sock)
        assert ans is not None and ans.status == 200, ans
        assert json.loads(ans.body)["usage"]["completion_tokens"] == 2
    finally:
        sock.close()


def test_a_body_over_the_limit_is_refused_before_it_is_read_on_every_route(small: Serve
                                                                          ) -> None:
    declared = 300 * 1024 * 1024
    for path in ("/v1/programs/x/release", "/nope", "/v1/chat/completions"):
        sock = connect(small, sndbuf=PIECE)
        try:
            sent, ans = send_until_answered(
                sock, post_head(path, f"content-length: {declared}\r\n"), zeros(declared))
            assert ans is not None and ans.status == 413, (path, ans)
            assert ans.error()["code"] == "request_too_large"
            assert sent < 8 * 1024 * 1024, (path, sent)
        finally:
            sock.close()
    # the Messages API's paths answer in its shape
    sock = connect(small)
    try:
        sock.sendall(post_head("/v1/messages", f"content-length: {declared}\r\n"))
        ans = read_answer(sock)
        assert ans is not None and ans.status == 413
        assert json.loads(ans.body)["type"] == "error"
    finally:
        sock.close()
    total = 32 * 1024 * 1024  # chunked: counted as it comes, refused past the limit
    # (an unknown path, and a release, are answered without reading the body at all: a
    # 404, unless the 413 comes first)
    for path, statuses in (("/nope", (404, 413)), ("/v1/programs/x/release", (404, 413)),
                           ("/v1/chat/completions", (413,))):
        sock = connect(small, sndbuf=PIECE)
        try:
            sent, ans = send_until_answered(
                sock, post_head(path, "transfer-encoding: chunked\r\n"), chunked(total))
            assert ans is not None and ans.status in statuses, (path, ans)
            assert sent < 8 * 1024 * 1024, (path, sent)
        finally:
            sock.close()
    assert httpx.get(small.url + "/healthz").status_code == 200


def test_the_connection_cap_closes_idle_connections_so_clients_are_served() -> None:
    s = serve("--max-connections", "20", "--header-timeout", "60")
    socks: list[socket.socket] = []
    try:
        for _ in range(40):  # twice the cap, all idle
            socks.append(connect(s))
            time.sleep(0.005)
        for _ in range(5):
            assert httpx.get(s.url + "/healthz", timeout=10).status_code == 200
        time.sleep(0.3)
        closed = [is_closed(x) for x in socks]
        assert closed[0] and sum(closed) >= 20, closed  # the longest idle went first
        assert s.logged("the connection cap binds")
        assert sum("the connection cap binds" in ln for ln in s.log) == 1  # once a minute
        for x in socks:
            x.close()
        socks.clear()
        time.sleep(0.5)
        # every open connection busy (a head on its way): a new one is refused with 503
        for _ in range(20):
            socks.append(connect(s))
            socks[-1].sendall(b"GET /healthz HTTP/1.1\r\n")
            time.sleep(0.01)
        time.sleep(0.3)
        extra = connect(s)
        socks.append(extra)
        ans = read_answer(extra)
        assert ans is not None and ans.status == 503, ans
        assert ans.error()["code"] == "too_many_connections"
        assert "retry-after" in ans.headers
        assert not any(is_closed(x) for x in socks[:20])  # the busy ones were kept
    finally:
        for x in socks:
            x.close()
        stop(s.proc)


def test_under_a_small_descriptor_limit_idle_connections_do_not_lock_clients_out() -> None:
    # the default --max-connections (4096) is lowered to what 300 descriptors allow
    s = serve(nofile=300)
    socks: list[socket.socket] = []
    try:
        assert s.logged("descriptor limit")
        for _ in range(400):  # more than the process could hold
            socks.append(connect(s))
        for _ in range(5):
            assert httpx.get(s.url + "/healthz", timeout=10).status_code == 200
        time.sleep(0.3)
        assert sum(is_closed(x) for x in socks) >= 400 - 300
        assert s.logged("the connection cap binds")
    finally:
        for x in socks:
            x.close()
        stop(s.proc)


@pytest.fixture(scope="module")
def workers() -> Iterator[Serve]:
    s = serve("--workers", "2", "--api-key", KEY, "--admin-key", ADMIN,
              "--max-body-bytes", str(1024 * 1024), "--header-timeout", "60")
    try:
        yield s
    finally:
        stop(s.proc)


def worker_connections(s: Serve) -> float:
    text = httpx.get(s.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=10).text
    return sum(v for labels, v in parse_prometheus(text).get("mori_connections_total", [])
               if labels.get("process", "").startswith("worker"))


def test_with_workers_every_route_checks_keys_and_the_limit_before_reading(workers: Serve
                                                                          ) -> None:
    # the policy process serves the first two open connections itself: hold them, so that
    # the requests below go to the workers (the pass-through route)
    held = [connect(workers), connect(workers)]
    try:
        before = worker_connections(workers)
        declared = 300 * 1024 * 1024
        n = 0
        for path in ("/nope", "/v1/programs/x/release"):
            sock = connect(workers, sndbuf=PIECE)
            n += 1
            try:
                sent, ans = send_until_answered(
                    sock, post_head(path, f"content-length: {declared}\r\n"), zeros(declared))
                assert ans is not None and ans.status == 413, (path, ans)
                assert sent < 8 * 1024 * 1024, (path, sent)
            finally:
                sock.close()
        total = 32 * 1024 * 1024
        for path, auth, status in (("/nope", "", 401), ("/v1/programs/x/release", "", 401),
                                   ("/v1/programs/x/release",
                                    f"authorization: Bearer {KEY}\r\n", 413)):
            sock = connect(workers, sndbuf=PIECE)
            n += 1
            try:
                sent, ans = send_until_answered(
                    sock, post_head(path, "transfer-encoding: chunked\r\n" + auth),
                    chunked(total))
                assert ans is not None and ans.status == status, (path, ans)
                assert ans.error()["code"] in ("invalid_api_key", "request_too_large")
                assert sent < 8 * 1024 * 1024, (path, sent)
            finally:
                sock.close()
        # a huge head on a worker: 431 too
        sock = connect(workers, sndbuf=PIECE)
        n += 1
        try:
            sent, ans = send_until_answered(
                sock, b"GET /v1/programs HTTP/1.1\r\nhost: localhost\r\nx-big: ",
                (b"a" * PIECE for _ in range(256)))
            assert ans is not None and ans.status == 431
        finally:
            sock.close()
        # they went to the workers; and an authenticated pass-through is still served
        deadline = time.monotonic() + 10
        while worker_connections(workers) < before + n and time.monotonic() < deadline:
            time.sleep(0.2)
        assert worker_connections(workers) >= before + n
        r = httpx.post(workers.url + "/v1/programs/x/release", json={},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "program_not_found"
    finally:
        for x in held:
            x.close()


def test_the_bounds_are_flags_and_config_keys_and_are_checked(tmp_path: Any) -> None:
    from mori.cli.main import build_parser
    from mori.cli.serve_cmd import ServeUsageError, build_config
    from mori.gateway.config import GatewaySettings

    f = tmp_path / "serve.toml"
    f.write_text("max-connections = 1024\nheader-timeout = 2.5\nkeep-alive-timeout = 5\n"
                 "max-header-bytes = 16384\n")
    cfg = build_config(build_parser().parse_args(["serve", "--config", str(f),
                                                  "--body-timeout", "3"]))
    s = cfg.settings
    assert (s.max_connections, s.header_timeout_s, s.keep_alive_timeout_s, s.body_timeout_s,
            s.max_header_bytes) == (1024, 2.5, 5.0, 3.0, 16384)
    d = GatewaySettings()
    assert (d.max_connections, d.header_timeout_s, d.keep_alive_timeout_s, d.body_timeout_s,
            d.max_header_bytes) == (4096, 10.0, 30.0, 30.0, 64 * 1024)
    for bad in (["--max-connections", "0"], ["--header-timeout", "0"],
                ["--body-timeout", "-1"], ["--max-header-bytes", "100"]):
        with pytest.raises(ServeUsageError):
            build_config(build_parser().parse_args(["serve", *bad]))
