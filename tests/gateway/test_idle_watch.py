"""``IdleWatch``: a wait past its deadline is cancelled and told apart from any other
cancellation; a later, shorter deadline takes effect (a stream's first wait may be long,
its next ones short); time not spent waiting does not count."""

from __future__ import annotations

import asyncio

import pytest

from mori.gateway.idle_watch import IdleWatch


async def wait_on(watch: IdleWatch, seconds: float, fut: asyncio.Future[None]) -> str:
    watch.arm(seconds)
    try:
        await fut
        return "done"
    except asyncio.CancelledError:
        if not watch.timed_out():
            raise
        return "timed out"
    finally:
        watch.disarm()


def test_a_wait_past_its_deadline_times_out() -> None:
    async def main() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        watch = IdleWatch(loop)
        t0 = loop.time()
        got = await wait_on(watch, 0.1, loop.create_future())
        watch.stop()
        return got, loop.time() - t0

    got, took = asyncio.run(main())
    assert got == "timed out" and 0.1 <= took < 1.0


def test_a_shorter_deadline_after_a_long_one_takes_effect() -> None:
    async def main() -> tuple[str, str, float]:
        loop = asyncio.get_running_loop()
        watch = IdleWatch(loop)
        first: asyncio.Future[None] = loop.create_future()
        loop.call_later(0.05, first.set_result, None)
        a = await wait_on(watch, 300.0, first)  # the first byte: a long limit
        t0 = loop.time()
        b = await wait_on(watch, 0.1, loop.create_future())  # then a short one
        watch.stop()
        return a, b, loop.time() - t0

    a, b, took = asyncio.run(main())
    assert (a, b) == ("done", "timed out") and took < 1.0


def test_time_between_waits_does_not_count() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        watch = IdleWatch(loop)
        got = []
        for _ in range(3):
            fut: asyncio.Future[None] = loop.create_future()
            loop.call_later(0.05, fut.set_result, None)
            got.append(await wait_on(watch, 0.1, fut))
            await asyncio.sleep(0.15)  # busy elsewhere (writing to a slow client)
        watch.stop()
        return got

    assert asyncio.run(main()) == ["done"] * 3


def test_another_cancellation_is_let_through() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        watch = IdleWatch(loop)
        task = asyncio.ensure_future(wait_on(watch, 0.1, loop.create_future()))
        loop.call_later(0.1, task.cancel)  # the client leaves as the deadline passes
        with pytest.raises(asyncio.CancelledError):
            await task
        watch.stop()

    asyncio.run(main())
