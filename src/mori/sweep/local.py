"""The local executor: runs in a pool of worker processes on this machine.

Executors share one shape: called with the runs to do and the trace set, they start
the work at once (workers are forked before the caller draws a progress bar) and return
a generator that yields ``(run, result)`` as runs finish, in completion order. Closing
the generator early (an error, Ctrl-C) cancels the queued runs and stops those
in flight.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import signal
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed

from mori.sim.metrics import RunResult
from mori.sim.runner import simulate
from mori.sweep.grid import Run
from mori.traces.model import TraceSet

Results = Generator[tuple[Run, RunResult], None, None]
"""What an executor returns: ``(run, result)`` pairs as the runs finish."""

Executor = Callable[[Sequence[Run], TraceSet], Results]
"""An executor with its options bound (see :func:`run_local`, ``ray_exec.run_ray``)."""


def _in_process(runs: Sequence[Run], traces: TraceSet) -> Results:
    for run in runs:
        yield run, simulate(run.config, traces)


def _ignore_sigint() -> None:
    """Worker initializer: Ctrl-C is the parent's to handle (it stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _gather(pool: ProcessPoolExecutor, futures: dict[Future[RunResult], Run],
            workers: list[multiprocessing.process.BaseProcess]) -> Results:
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


def run_local(runs: Sequence[Run], traces: TraceSet, jobs: int) -> Results:
    """Run ``runs`` in ``jobs`` worker processes (in this process when ``jobs`` <= 1 or
    there is at most one run); yield ``(run, result)`` as each finishes.

    Each task carries the trace set (pickled, tens of kB), so workers hold no state.
    """
    if jobs <= 1 or len(runs) <= 1:
        return _in_process(runs, traces)
    others = set(multiprocessing.active_children())
    pool = ProcessPoolExecutor(min(jobs, len(runs)), initializer=_ignore_sigint)
    try:
        futures = {pool.submit(simulate, run.config, traces): run for run in runs}
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    # the pool starts its workers while the runs are submitted
    workers = [p for p in multiprocessing.active_children() if p not in others]
    return _gather(pool, futures, workers)
