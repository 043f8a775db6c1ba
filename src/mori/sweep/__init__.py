"""Sweeps: grids of simulation runs, resumable, on local processes or Ray.

``grid`` defines sweeps and the registry of named ones (``paper``, ``smoke``); ``store``
keeps one record per finished run under the output folder and the combined outputs;
``local`` and ``ray_exec`` are the executors; ``run`` validates, resumes and records.
The command line is ``mori sweep`` (:mod:`mori.cli.sweep_cmd`).
"""

from mori.sweep.grid import SWEEPS, Block, Run, Setting, SweepDef, expand, settings_of

__all__ = ["SWEEPS", "Block", "Run", "Setting", "SweepDef", "expand", "settings_of"]
