"""The lean HTTP/1.1 client (``mori.engines.http1_client``): refused, silent, dying and oversized
engines, the client leaving, and how the adapter maps each failure to a status."""

from __future__ import annotations

import asyncio
import time

import pytest

from mori.engines.base import RequestHints, UpstreamError
from mori.engines.http import OpenAIHTTPAdapter
from mori.engines.http1_client import BrokenError, ReadTimeout, RefusedError

from .http1_server import Server, free_port, pool, run

# -- failures ---------------------------------------------------------------------------------

def test_refused_port() -> None:
    async def go() -> None:
        with pytest.raises(RefusedError):
            await pool(f"http://127.0.0.1:{free_port()}").post("/", b"", {})
    run(go)


def test_silent_engine_times_out() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        if len(s.requests) == 2:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await s.wait_eof(r)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url, read_timeout=0.2)
            t = time.monotonic()
            with pytest.raises(ReadTimeout):
                await p.post("/", b"", {})  # no head
            assert time.monotonic() - t < 1.0
            r = await p.post("/", b"", {})
            with pytest.raises(ReadTimeout):
                await r.read()  # the head, then silence mid-body
            await asyncio.wait_for(s.eof.wait(), 1)
            assert s.eofs >= 1 and not p._all
    run(go)


@pytest.mark.parametrize("chunked", [False, True])
def test_engine_dying_mid_body_is_broken(chunked: bool) -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        if chunked:
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        else:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nfirst")
        await w.drain()
        await asyncio.sleep(0.05)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            r = await p.post("/", b"", {})
            got = []
            with pytest.raises(BrokenError):
                async for c in r.chunks():
                    got.append(c)
            assert b"".join(got) == b"first"
            r.release()
            r = await p.post("/", b"", {})
            with pytest.raises(BrokenError):
                await r.read()
            r.release()
            assert s.accepted == 2 and not p._all
    run(go)


def test_huge_headers_are_broken() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        w.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(200_000):  # 20 MB of headers, unless the client gives up first
            w.write(b"x-h%d: %s\r\n" % (i, b"v" * 100))
            if i % 1000 == 0:
                await w.drain()
        w.write(b"content-length: 0\r\n\r\n")
        await s.wait_eof(r)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            with pytest.raises(BrokenError):
                await p.post("/", b"", {})
            assert not p._all
    run(go)


# -- the client leaving --------------------------------------------------------------------

def test_closing_a_half_read_answer_closes_the_engine_side() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        await s.wait_eof(r)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            r = await p.post("/", b"", {})
            async for c in r.chunks():
                assert c == b"data: "
                break
            r.close()
            await asyncio.wait_for(s.eof.wait(), 1)
            assert not p._all and not p._idle
    run(go)


def test_cancelled_post_leaves_no_connection() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        await s.wait_eof(r)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url)
            task = asyncio.create_task(p.post("/", b"", {}))
            await asyncio.sleep(0.1)
            assert len(p._all) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not p._all and not p._idle
            await asyncio.wait_for(s.eof.wait(), 1)
    run(go)


def test_pool_close_wakes_a_waiting_reader() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nab")
        await s.wait_eof(r)

    async def go() -> None:
        async with Server(handler) as s:
            p = pool(s.url, read_timeout=None)
            r = await p.post("/", b"", {})
            reader = asyncio.create_task(r.read())
            await asyncio.sleep(0.05)
            await p.close()
            with pytest.raises(BrokenError):
                await asyncio.wait_for(reader, 1)
    run(go)


# -- the adapter's mapping ---------------------------------------------------------------------

def test_adapter_maps_refused_timeout_and_broken_to_503_504_502() -> None:
    async def handler(s: Server, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await s.request(r)
        if b"/hang" in s.requests[-1][0]:
            await s.wait_eof(r)
        # /drop: closed unanswered

    async def status(a: OpenAIHTTPAdapter, path: str) -> int:
        with pytest.raises(UpstreamError) as e:
            await a.forward(path, {"model": "m"}, False, RequestHints("p"))
        return e.value.status

    async def go() -> None:
        async with Server(handler) as s:
            for url, path, want in ((f"http://127.0.0.1:{free_port()}", "/x", 503),
                                    (s.url, "/hang", 504), (s.url, "/drop", 502)):
                a = OpenAIHTTPAdapter(url, timeout_s=0.2, connect_timeout_s=1.0)
                await a.start()
                try:
                    assert await status(a, path) == want
                finally:
                    await a.close()
    run(go)
