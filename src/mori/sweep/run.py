"""Running a sweep with resume: check every run, skip recorded ones, record each result.

The caller (``mori sweep``) picks the executor and writes the combined outputs; this
module owns the order of things: validate everything before any run, split the grid into
recorded and pending runs, and record each result the moment it arrives.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import closing
from typing import Any

from tqdm import tqdm

from mori.sim.metrics import RunResult
from mori.sim.runner import Simulation
from mori.sweep.grid import Run
from mori.sweep.local import Executor
from mori.sweep.store import RunStore
from mori.traces.model import TraceSet


def validate(runs: Sequence[Run], traces: TraceSet) -> None:
    """Build (and discard) a :class:`Simulation` for each setting and policy of ``runs``.

    Raises :class:`~mori.sim.runner.SettingsError` (or ``ValueError``) for settings that
    cannot be simulated; costs a few milliseconds each.
    """
    checked: set[tuple[object, str]] = set()
    for run in runs:
        what = (run.setting, run.config.policy)
        if what not in checked:
            checked.add(what)
            Simulation(run.config, traces)


def partition(runs: Sequence[Run], store: RunStore, fresh: bool
              ) -> tuple[dict[Run, RunResult], list[Run]]:
    """The runs already recorded (with their results) and the runs to do, in grid order.

    With ``fresh`` every run is to do (its old record, if any, is overwritten).
    """
    done: dict[Run, RunResult] = {}
    todo: list[Run] = []
    for run in runs:
        result = None if fresh else store.load(run)
        if result is None:
            todo.append(run)
        else:
            done[run] = result
    return done, todo


def execute(todo: Sequence[Run], traces: TraceSet, store: RunStore, executor: Executor,
            total: int, quiet: bool) -> dict[Run, RunResult]:
    """Run ``todo`` with ``executor``, recording each result in ``store`` as it arrives.

    Runs are submitted largest first (results are keyed by run, so the outputs keep
    the grid order). A progress bar over all ``total`` runs of the sweep (the recorded ones counted as
    done) goes to stderr unless ``quiet``. An exception or Ctrl-C stops the sweep; what
    was recorded stays recorded.
    """
    results: dict[Run, RunResult] = {}
    if not todo:
        return results
    # biggest runs first (by simulated programs), so a long run does not start last
    ordered = sorted(todo, key=lambda r: -r.config.programs)
    stream = executor(ordered, traces)  # the work starts now, before the bar's thread
    bar: tqdm[Any] = tqdm(total=total, initial=total - len(todo), desc="sweeping", unit="run",
                          file=sys.stderr, disable=quiet, dynamic_ncols=True)
    with closing(stream), bar:
        for run, result in stream:
            store.save(run, result)
            results[run] = result
            bar.set_postfix_str(f"{run.setting.stem} {run.config.policy} "
                                f"n={run.programs_per_replica}", refresh=False)
            bar.update()
    return results
