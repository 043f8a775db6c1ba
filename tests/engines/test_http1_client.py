"""The lean HTTP/1.1 client (``mori.engines.http1_client``): answers, keep-alive and the
limit on an answer read whole (the adapter's control-plane calls' too), against raw
asyncio servers (``http1_server``), so every byte the "engine" sends is under the test's
control."""

from __future__ import annotations

import asyncio
import re

import pytest

from mori.engines.base import ResponseTooLarge
from mori.engines.http import OpenAIHTTPAdapter
from mori.engines.http1_client import BrokenError, TooLargeError

from .http1_server import Handler, Server, answer, keep_alive, pool, run

# -- answers --------------------------------------------------------------------------------

def test_content_length_body_and_the_request_on_the_wire() -> None:
    async def go() -> None:
        async with Server(keep_alive(b'{"id":"x"}')) as s:
            p = pool(s.url + "/base/")
            r = await p.post("/v1/chat", b'{"a":1}', {"content-type": "application/json",
                                                      "x-extra": "v"})
            assert r.status == 200 and r.content_type == "application/json"
            assert await r.read() == b'{"id":"x"}' and r.at_eof
            r.release()
            assert len(p._idle) == 1 and len(p._all) == 1
            head, body = s.requests[0]
            assert head.startswith(b"POST /base/v1/chat HTTP/1.1\r\n")
            assert b"\r\nhost: 127.0.0.1:" in head and b"\r\nx-extra: v\r\n" in head
            assert body == b'{"a":1}'
            await p.close()
            assert not p._all and not p._idle
    run(go)


def test_chunked_sse_passes_through_in_pieces() -> None:
    events = [b"data: %d\n\n" % i for i in range(4)] + [b"data: [DONE]\n\n"]

    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await s.request(r) is not None:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                    b"transfer-encoding: chunked\r\n\r\n")
            for e in events:
                w.write(b"%x\r\n%s\r\n" % (len(e), e))
                await w.drain()
                await asyncio.sleep(0.03)
            w.write(b"0\r\n\r\n")

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            r = await p.post("/v1/chat", b"{}", {})
            assert r.content_type == "text/event-stream"
            got = [c async for c in r.chunks()]
            assert len(got) > 1 and b"".join(got) == b"".join(events)
            r.release()
            r = await p.post("/v1/chat", b"{}", {})  # the same connection, parser reused
            assert await r.read() == b"".join(events)
            r.release()
            assert s.accepted == 1
            await p.close()
    run(go)


def test_body_ending_at_eof_reads_fully() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        version = b"1.0" if s.accepted == 1 else b"1.1"
        w.write(b"HTTP/" + version + b" 200 OK\r\ncontent-type: text/plain\r\n\r\npart one, ")
        await w.drain()
        await asyncio.sleep(0.02)
        w.write(b"part two")

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            for _ in range(2):  # an HTTP/1.0 server, then HTTP/1.1 without a length
                r = await p.post("/", b"", {})
                assert await r.read() == b"part one, part two"
                r.release()
            assert s.accepted == 2 and not p._all
    run(go)


def test_no_body_statuses_and_an_interim_answer() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await s.request(r) is not None:
            n = len(s.requests)
            if n == 1:
                w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            elif n == 2:
                w.write(b"HTTP/1.1 304 Not Modified\r\netag: x\r\n\r\n")
            else:  # the interim answer on its own, then the real one
                w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                await w.drain()
                await asyncio.sleep(0.05)
                w.write(answer(b"final"))

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            for status, body in ((204, b""), (304, b""), (200, b"final")):
                r = await p.post("/", b"x", {})
                assert r.status == status and await r.read() == body
                r.release()
            assert s.accepted == 1
            await p.close()
    run(go)


def test_big_body_is_read_intact_through_flow_control() -> None:
    big = bytes(range(256)) * (8 * 4096)  # 8 MiB

    async def go() -> None:
        async with Server(keep_alive(big)) as s:
            p = pool(s.url)
            r = await p.post("/", b"", {})
            await asyncio.sleep(0.2)  # not reading: the connection stops reading
            assert r._conn.paused and r._buffered < 4 << 20
            assert await r.read() == big
            r.release()
            r = await p.post("/", b"", {})  # resumed and reused
            assert await r.read() == big
            r.release()
            assert s.accepted == 1
            await p.close()
    run(go)


def test_answer_sent_before_the_request_is_read() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 413 Too Large\r\nconnection: close\r\ncontent-length: 4\r\n\r\nbig!")
        await w.drain()
        n = int(re.search(rb"content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        await r.readexactly(n)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            r = await p.post("/", b"x" * (4 << 20), {})
            assert r.status == 413 and await r.read() == b"big!"
            r.release()
            assert not p._all
    run(go)


# -- keep-alive -------------------------------------------------------------------------------

def test_keep_alive_reuses_one_connection() -> None:
    async def go() -> None:
        async with Server(keep_alive()) as s:
            p = pool(s.url)
            for _ in range(3):
                r = await p.post("/", b"{}", {})
                assert await r.read() == b'{"ok":1}'
                r.release()
            assert s.accepted == 1 and len(s.requests) == 3
            await p.close()
    run(go)


@pytest.mark.parametrize("version, extra", [(b"1.1", b"connection: close"), (b"1.0", b"")])
def test_connection_close_answers_are_not_reused(version: bytes, extra: bytes) -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        w.write(answer(b"bye", *([extra] if extra else []), version=version))
        await s.wait_eof(r)  # the client must be the one to close (or we'd race it)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            for _ in range(2):
                r = await p.post("/", b"", {})
                assert await r.read() == b"bye"
                r.release()
                assert not p._idle and not p._all
            assert s.accepted == 2
    run(go)


def test_idle_connection_closed_by_the_engine_is_not_reused() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        w.write(answer(b"one"))  # keep-alive announced, then closed anyway

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            for _ in range(2):
                r = await p.post("/", b"", {})
                assert await r.read() == b"one"
                r.release()
                await asyncio.sleep(0.05)  # the close arrives while idle
                assert not p._idle and not p._all
            assert s.accepted == 2
    run(go)


def test_reused_connection_closed_on_the_request_is_retried_once() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        w.write(answer(b"fine"))
        await s.request(r)  # the next request on this connection: closed unanswered

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            for _ in range(3):
                r = await p.post("/", b"{}", {})
                assert await r.read() == b"fine"
                r.release()
            assert s.accepted == 3 and len(s.requests) == 5
            await p.close()
    run(go)


def test_fresh_connection_closed_unanswered_is_broken_not_retried() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            with pytest.raises(BrokenError):
                await p.post("/", b"", {})
            assert s.accepted == 1 and not p._all
    run(go)


def test_stray_bytes_after_an_answer_drop_the_connection() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await s.request(r) is not None:
            w.write(answer(b"a") + b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nb")

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            for _ in range(2):
                r = await p.post("/", b"", {})
                assert r.status == 200 and await r.read() == b"a"
                r.release()
            assert s.accepted == 2
            await p.close()
    run(go)


def test_max_idle_bounds_the_pool() -> None:
    async def go() -> None:
        async with Server(keep_alive()) as s:
            p = pool(s.url, max_idle=1)
            rs = [await p.post("/", b"", {}) for _ in range(3)]
            for r in rs:
                await r.read()
                r.release()
            assert len(p._idle) == 1 and len(p._all) == 1
            await p.close()
    run(go)


# -- the size limit of an answer read whole ------------------------------------------------

LIMIT = 64 * 1024
SOCKET_READ = 256 * 1024  # the most one read of the socket hands the parser (asyncio's)


def _chunked_flood(total: int) -> Handler:
    """Answers each request with ``total`` bytes in 16 KiB chunks; the client leaving
    (seen as EOF, or as a write that fails) sets ``eof``."""
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        piece = b"x" * 16384
        try:
            while await s.request(r) is not None:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"transfer-encoding: chunked\r\n\r\n")
                for _ in range(total // len(piece)):
                    w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await w.drain()
                w.write(b"0\r\n\r\n")
        except ConnectionError:
            pass
        s.eofs += 1
        s.eof.set()
    return handler


def test_a_declared_length_over_the_limit_fails_before_the_body_is_read() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n" + b"x" * 1000)
        await s.wait_eof(r)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            r = await p.post("/", b"", {})
            with pytest.raises(TooLargeError, match="Content-Length is 100000000") as e:
                await r.read(LIMIT)
            assert e.value.limit == LIMIT and isinstance(e.value, BrokenError)
            await asyncio.wait_for(s.eof.wait(), 1)  # the engine saw the client leave
            assert not p._all and not p._idle and r._buffered == 0
            r.release()  # after the failure: nothing more happens
            assert not p._all
    run(go)


def test_a_chunked_answer_is_cut_off_as_it_passes_the_limit() -> None:
    async def go() -> None:
        async with Server(_chunked_flood(64 << 20)) as s:  # 1,000 times the limit
            p = pool(s.url)
            r = await p.post("/", b"", {})
            with pytest.raises(TooLargeError, match=f"over {LIMIT} bytes arrived"):
                await r.read(LIMIT)
            # what was taken in is the limit plus at most one read of the socket
            assert LIMIT < r._received <= LIMIT + SOCKET_READ
            assert r._buffered == 0 and not r._buf
            await asyncio.wait_for(s.eof.wait(), 1)
            assert not p._all and not p._idle
    run(go)


def test_an_answer_all_in_before_the_read_is_still_held_to_the_limit() -> None:
    async def go() -> None:
        async with Server(_chunked_flood(4 * LIMIT)) as s:
            p = pool(s.url)
            r = await p.post("/", b"", {})
            await asyncio.sleep(0.2)  # all of it arrives before read() is called
            assert r._received == 4 * LIMIT
            with pytest.raises(TooLargeError):
                await r.read(LIMIT)
            assert not r._buf and not p._all
            await asyncio.wait_for(s.eof.wait(), 1)
    run(go)


@pytest.mark.parametrize("chunked", [False, True])
def test_an_answer_of_exactly_the_limit_is_read_and_the_connection_kept(
        chunked: bool) -> None:
    body = b"y" * LIMIT
    handler = _chunked_flood(LIMIT) if chunked else keep_alive(body)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            r = await p.post("/", b"", {})
            got = await r.read(LIMIT)
            assert len(got) == LIMIT and got == (b"x" * LIMIT if chunked else body)
            r.release()
            assert len(p._idle) == 1  # a whole answer: the connection goes back
            await p.close()
    run(go)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_control_plane_answer_over_the_limit_is_refused(chunked: bool) -> None:
    small = b'{"data": [{"id": "m"}]}'

    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while (head := await s.request(r)) is not None:
                if b"/small" in head:
                    w.write(answer(small))
                elif chunked:
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                            b"transfer-encoding: chunked\r\n\r\n")
                    for _ in range(1024):  # 16 MiB, 256 times the limit
                        w.write(b"4000\r\n" + b"x" * 16384 + b"\r\n")
                        await w.drain()
                else:
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100000000\r\n\r\n")
        except ConnectionError:
            pass
        s.eof.set()

    async def go() -> None:
        async with Server(handler) as s:
            a = OpenAIHTTPAdapter(s.url)
            a.max_response_bytes = LIMIT
            await a.start()
            try:
                assert await a.get_json("/small") == {"data": [{"id": "m"}]}
                with pytest.raises(ResponseTooLarge, match=f"over {LIMIT} bytes") as e:
                    await a.get_json("/v1/models")
                assert e.value.status == 502 and not e.value.unhealthy
                await asyncio.wait_for(s.eof.wait(), 2)  # the connection was dropped
            finally:
                await a.close()
    run(go)
