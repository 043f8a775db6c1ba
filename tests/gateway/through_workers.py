"""The whole gateway (``run_gateway``, as ``mori serve`` runs it) on a test's loop thread,
with ``--workers``: every connection handed to a worker process
(``policy_connections=0``), so a test's requests take the worker's path and the API
tests run through workers as through the policy process.

``VIA`` names the two ways; a fixture parametrized over it serves its tests both ways.
"""

from __future__ import annotations

import asyncio
import gc
from concurrent.futures import Future

from gateway_harness import LoopThread

from mori.gateway.server import ServeConfig, run_gateway

VIA = ("policy", "workers")
"""Who serves a test's connections: the policy process itself, or a worker."""


class WorkersGateway:
    """``run_gateway(cfg)`` with ``cfg.workers`` processes, running on ``lt``; ``close()``
    stops it as ``mori serve`` stops (programs ended, the record written, workers
    stopped)."""

    def __init__(self, lt: LoopThread, cfg: ServeConfig, timeout_s: float = 60.0) -> None:
        assert cfg.workers > 1 and cfg.policy_connections == 0, "every connection to a worker"
        self.lt = lt
        self._gc = gc.get_threshold()  # run_gateway tunes the collector for serving
        ready: Future[str] = Future()
        self._stop: asyncio.Event = lt.call(_event())

        def on_ready(url: str) -> None:
            ready.set_result(url)

        self._run = asyncio.run_coroutine_threadsafe(
            run_gateway(cfg, on_ready, self._stop), lt.loop)
        self._run.add_done_callback(lambda f: ready.done() or ready.set_exception(
            f.exception() or RuntimeError("the gateway stopped before it listened")))
        self.url = ready.result(timeout_s)
        lt.handles.append(self)  # stopped with the loop thread, if not before

    async def stop(self) -> None:
        """For ``LoopThread.close``: the same as ``close`` (from the loop's thread)."""
        self._stop.set()
        await asyncio.wrap_future(self._run)

    def close(self, timeout_s: float = 30.0) -> None:
        if not self._run.done():
            self.lt.loop.call_soon_threadsafe(self._stop.set)
            self._run.result(timeout_s)
        gc.unfreeze()
        gc.set_threshold(*self._gc)


async def _event() -> asyncio.Event:
    return asyncio.Event()


def workers_config(**kwargs: object) -> ServeConfig:
    """A ``ServeConfig`` of two gateway processes, every connection on the worker."""
    return ServeConfig(workers=2, policy_connections=0, port=0, log_level="warning",
                       **kwargs)  # type: ignore[arg-type]

