"""The Ray executor: each run is a Ray task, on a local instance or an existing cluster.

Ray is imported only here and only when asked for (``mori sweep --ray``); it is the
optional extra ``mori[ray]``. The trace set is put in Ray's object store once and every
task receives it by reference. On a cluster, ``mori`` must be importable on the workers
(installed there, as on the driver).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mori.sim.config import SimConfig
from mori.sim.metrics import RunResult
from mori.sim.runner import simulate
from mori.sweep.grid import Run
from mori.sweep.local import Results
from mori.traces.model import TraceSet

INSTALL_HINT = "pip install 'mori[ray]'"


class RayUnavailableError(RuntimeError):
    """Ray is not installed (a usage error: exit status 2)."""


class RayStartError(RuntimeError):
    """Ray is installed but could not be started or reached."""


def import_ray() -> Any:
    """The ``ray`` module, or :class:`RayUnavailableError` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise RayUnavailableError(
            f"--ray needs Ray, which is not installed ({e}); install it with: {INSTALL_HINT}"
        ) from None
    return ray


def _simulate_task(config: SimConfig, traces: TraceSet) -> RunResult:
    """The body of one Ray task (module level, so workers import it by name)."""
    return simulate(config, traces)


def _start(ray: Any, jobs: int | None, address: str | None) -> bool:
    """Connect to ``address`` or start a local instance; True if this call did ``ray.init``."""
    if ray.is_initialized():
        return False  # the caller's session: use it, leave it running
    try:
        if address:
            ray.init(address=address, log_to_driver=False, ignore_reinit_error=True)
        else:
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True)
    except Exception as e:
        where = f"the Ray cluster at {address!r}" if address else "a local Ray instance"
        raise RayStartError(f"cannot start or reach {where}: {e}") from e
    return True


def _gather(ray: Any, refs: dict[Any, Run], started: bool) -> Results:
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield refs[ref], ray.get(ref)
    finally:
        for ref in pending:  # an error or an early close: drop what is left
            ray.cancel(ref)
        if started:
            ray.shutdown()


def run_ray(runs: Sequence[Run], traces: TraceSet, jobs: int | None,
            address: str | None) -> Results:
    """Run ``runs`` as Ray tasks; yield ``(run, result)`` as each finishes.

    With ``address`` (``auto``, ``ray://host:10001``, ...) it joins that cluster, else it
    starts a local instance with ``jobs`` CPUs (Ray's choice when None). Ray is shut down
    at the end only if this call initialised it.
    """
    ray = import_ray()
    started = _start(ray, jobs, address)
    try:
        traces_ref = ray.put(traces)
        task = ray.remote(_simulate_task)
        refs = {task.remote(run.config, traces_ref): run for run in runs}
    except BaseException:
        if started:
            ray.shutdown()
        raise
    return _gather(ray, refs, started)
