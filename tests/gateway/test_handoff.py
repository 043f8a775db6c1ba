"""Dealing connections out (``mori.gateway.handoff``), on real sockets in one process: the
policy process keeps the first ``keep`` open connections, hands the next ones to the
workers' lines in turn, skips a line whose worker is gone, serves everything itself when
no line takes it, pauses after a failed accept, and a worker serves what arrives on its
line."""

from __future__ import annotations

import asyncio
import socket

import pytest

from mori.gateway import handoff
from mori.gateway.handoff import Dealer, Served, take_connections


class Echo(asyncio.Protocol):
    """Answers every read with ``tag + data``."""

    def __init__(self, tag: bytes) -> None:
        self.tag = tag

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(self.tag + data)


async def ask(port: int, text: bytes) -> tuple[bytes, asyncio.StreamWriter]:
    """Open a connection, send ``text``, return the answer (the connection stays open)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(text)
    await w.drain()
    return await asyncio.wait_for(r.read(100), 5), w


def listener() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s, s.getsockname()[1]


def test_keeps_the_first_connections_and_hands_the_rest_out_in_turn() -> None:
    async def main() -> None:
        sock, port = listener()
        dealt: list[int] = []
        dealer = Dealer(sock, Served(lambda: Echo(b"policy:")), keep=1, on_dealt=dealt.append)
        w1, w2 = dealer.line(1), dealer.line(2)  # the workers' ends, served here by tasks
        take_connections(w1, Served(lambda: Echo(b"w1:")))
        take_connections(w2, Served(lambda: Echo(b"w2:")))
        dealer.start()
        answers, writers = [], []
        for i in range(4):
            got, w = await ask(port, b"x%d" % i)
            answers.append(got)
            writers.append(w)
        assert answers == [b"policy:x0", b"w1:x1", b"w2:x2", b"w1:x3"]
        assert dealt == [0, 1, 2, 1]
        # the kept connection closes: the next new one is kept again
        writers[0].close()
        await asyncio.sleep(0.1)
        got, last = await ask(port, b"x4")
        assert got == b"policy:x4" and dealt[-1] == 0
        for w in [*writers, last]:
            w.close()
        dealer.stop()
        w1.close()
        w2.close()
        sock.close()

    asyncio.run(main())


def test_a_gone_worker_is_skipped_and_with_none_left_the_policy_process_serves() -> None:
    async def main() -> None:
        sock, port = listener()
        dealt: list[int] = []
        dealer = Dealer(sock, Served(lambda: Echo(b"policy:")), keep=1, on_dealt=dealt.append)
        w1, w2 = dealer.line(1), dealer.line(2)
        take_connections(w2, Served(lambda: Echo(b"w2:")))
        w1.close()  # worker 1 is gone
        dealer.start()
        got = [await ask(port, b"a"), await ask(port, b"b"), await ask(port, b"c")]
        assert [g for g, _ in got] == [b"policy:a", b"w2:b", b"w2:c"]
        asyncio.get_running_loop().remove_reader(w2.fileno())
        w2.close()  # now no worker takes connections: the policy process serves them
        got.append(await ask(port, b"d"))
        assert got[-1][0] == b"policy:d" and dealt == [0, 2, 2, 0]
        # a new line for worker 1 (it was started again) is used from then on
        w1 = dealer.line(1)
        take_connections(w1, Served(lambda: Echo(b"w1 again:")))
        got.append(await ask(port, b"e"))
        assert got[-1][0] == b"w1 again:e"
        for _, w in got:
            w.close()
        dealer.stop()
        w1.close()
        sock.close()

    asyncio.run(main())


def test_a_worker_stops_taking_connections_when_its_line_closes() -> None:
    async def main() -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        take_connections(theirs, Served(lambda: Echo(b"w:")))
        loop = asyncio.get_running_loop()
        mine.close()
        await asyncio.sleep(0.05)
        assert not loop.remove_reader(theirs.fileno())  # it had removed its reader
        theirs.close()

    asyncio.run(main())


class RunsOutOnce:
    """A listening socket whose first accept fails as when out of file descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.failed = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self.sock.setblocking(flag)

    def accept(self) -> tuple[socket.socket, object]:
        if not self.failed:
            self.failed += 1
            raise OSError(24, "Too many open files")
        return self.sock.accept()


def test_a_failed_accept_pauses_then_the_waiting_connection_is_served(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(handoff, "ACCEPT_PAUSE_S", 0.2)

    async def main() -> None:
        sock, port = listener()
        flaky = RunsOutOnce(sock)
        dealer = Dealer(flaky, Served(lambda: Echo(b"policy:")))  # type: ignore[arg-type]
        dealer.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        got, w = await ask(port, b"q")
        # not a busy loop on the failing accept: one failure, then a pause
        assert got == b"policy:q" and flaky.failed == 1 and loop.time() - t0 >= 0.15
        w.close()
        dealer.stop()
        sock.close()

    asyncio.run(main())
    assert "Too many open files" in caplog.text
