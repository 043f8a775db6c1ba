"""The local executor: runs in a pool of worker processes on this machine.

Executors share one shape: called with the runs to do and the trace set, they start
the work at once (workers are forked before the caller draws a progress bar) and return
a generator that yields ``(run, result)`` as runs finish, in completion order. Closing
the generator early (an error, Ctrl-C) cancels the runs not yet started.
"""

from __future__ import annotations

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


def _gather(pool: ProcessPoolExecutor, futures: dict[Future[RunResult], Run]) -> Results:
    finished = False
    try:
        for future in as_completed(futures):
            yield futures[future], future.result()
        finished = True
    finally:
        # on an error or an early close, drop the queued runs and do not wait for the
        # ones in flight (their results would be lost anyway)
        pool.shutdown(wait=finished, cancel_futures=not finished)


def run_local(runs: Sequence[Run], traces: TraceSet, jobs: int) -> Results:
    """Run ``runs`` in ``jobs`` worker processes (in this process when ``jobs`` <= 1 or
    there is at most one run); yield ``(run, result)`` as each finishes.

    Each task carries the trace set (pickled, tens of kB), so workers hold no state.
    """
    if jobs <= 1 or len(runs) <= 1:
        return _in_process(runs, traces)
    pool = ProcessPoolExecutor(min(jobs, len(runs)))
    try:
        futures = {pool.submit(simulate, run.config, traces): run for run in runs}
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return _gather(pool, futures)
