"""The local executor: runs in a pool of worker processes on this machine.

``run_pool`` is the pool itself, for any picklable work: ``mori simulate`` runs its grid
through it too (with timelines when asked), ``mori sweep`` through ``run_local``.

Executors share one shape: called with the runs to do and the trace set, they start
the work at once (workers are forked before the caller draws a progress bar) and return
a generator that yields ``(run, result)`` as runs finish, in completion order. Closing
the generator early (an error, Ctrl-C) cancels the queued runs and stops those
in flight.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.process
import signal
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import closing
from typing import TypeVar

from mori.sim.metrics import RunResult
from mori.sim.runner import simulate
from mori.sweep.grid import Run
from mori.traces.model import TraceSet

Results = Generator[tuple[Run, RunResult], None, None]
"""What an executor returns: ``(run, result)`` pairs as the runs finish."""

T = TypeVar("T")
R = TypeVar("R")

Executor = Callable[[Sequence[Run], TraceSet], Results]
"""An executor with its options bound (see :func:`run_local`, ``ray_exec.run_ray``)."""


def _ignore_sigint() -> None:
    """Worker initializer: Ctrl-C is the parent's to handle (it stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _in_process(items: Sequence[T], work: Callable[[T], R]) -> Generator[tuple[int, R], None, None]:
    for i, item in enumerate(items):
        yield i, work(item)


def _gather(pool: ProcessPoolExecutor, futures: dict[Future[R], int],
            workers: list[multiprocessing.process.BaseProcess]
            ) -> Generator[tuple[int, R], None, None]:
    finished = False
    try:
        for future in as_completed(futures):
            yield futures[future], future.result()
        finished = True
    finally:
        if not finished:
            # an error, Ctrl-C or an early close: drop the queued runs and stop the
            # ones in flight now (their results would be lost anyway)
            pool.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                worker.terminate()
        pool.shutdown(wait=True)


def run_pool(items: Sequence[T], work: Callable[[T], R], jobs: int
             ) -> Generator[tuple[int, R], None, None]:
    """Apply ``work`` to each of ``items`` in ``jobs`` worker processes (in this process
    when ``jobs`` <= 1 or there is at most one item); yield ``(index, result)`` as each
    finishes, in completion order. The work starts before this returns.

    ``work`` must pickle: a module-level function, or a ``functools.partial`` of one
    (each task carries its arguments, so workers hold no state). A worker's exception
    is raised here; closing the generator early stops the rest.
    """
    if jobs <= 1 or len(items) <= 1:
        return _in_process(items, work)
    others = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(min(jobs, len(items)), initializer=_ignore_sigint)
    try:
        futures = {pool.submit(work, item): i for i, item in enumerate(items)}
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    # the pool starts its workers while the items are submitted
    workers = [p for p in multiprocessing.active_children() if p not in others]
    return _gather(pool, futures, workers)


def _simulate(run: Run, traces: TraceSet) -> RunResult:
    return simulate(run.config, traces)


def _keyed(runs: Sequence[Run], stream: Generator[tuple[int, RunResult], None, None]) -> Results:
    with closing(stream):
        for i, result in stream:
            yield runs[i], result


def run_local(runs: Sequence[Run], traces: TraceSet, jobs: int) -> Results:
    """Run ``runs`` in ``jobs`` worker processes (``run_pool``); yield ``(run, result)``
    as each finishes. Each task carries the trace set (pickled, tens of kB)."""
    return _keyed(runs, run_pool(runs, functools.partial(_simulate, traces=traces), jobs))
