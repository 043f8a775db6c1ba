"""A sweep's results on disk: one record per finished run, and the combined outputs.

Each finished run is written at once to ``DIR/runs/<key>.json`` (a temporary file, then
``os.replace``, so a record is either whole or absent), where ``key`` is a stable hash
of the run's full :class:`SimConfig` and the content of its trace set. A later sweep
over the same grid finds the record and skips the run; an interrupted sweep therefore
loses at most the runs in flight. The simulator's code is not part of the key: after
changing it, rerun with ``--fresh``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
import typing
import uuid
from pathlib import Path
from typing import Any

from mori.core.policy import PolicyConfig
from mori.sim import MODEL_VERSION
from mori.sim.config import SimConfig
from mori.sim.metrics import RESULT_CONTEXT, RESULT_SETTINGS, RunResult
from mori.sweep.grid import Run
from mori.traces.model import TraceSet

RECORD_FORMAT = 2
"""Version of the run-record layout; part of every key. 2: the time a request is held is
named so everywhere (``held_mean_s``, ``PolicyConfig.exclude_held``); a record of an
earlier format is not read, and its run is run again."""

RUNS_DIR = "runs"


def _sha256_json(obj: object) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def trace_digest(traces: TraceSet) -> str:
    """A SHA-256 of the trace set's content (name, programs, steps, subagents)."""
    return _sha256_json(dataclasses.asdict(traces))


def config_dict(config: SimConfig) -> dict[str, Any]:
    """``config`` as a JSON-able dict, float fields as floats (so 1 and 1.0 agree); the
    nested :class:`~mori.core.policy.PolicyConfig` as a nested dict, the same way.
    Settings added later (``OPTIONAL_SETTINGS``) are left out at their defaults, so the
    keys of earlier runs stay as they were."""
    out = _fields_dict(config)
    for name, default in OPTIONAL_SETTINGS.items():
        if name in out and out[name] == default:
            del out[name]
    policy = out.get("policy_config")
    if isinstance(policy, dict) and "recompute_tok_s" in policy and \
            policy["recompute_tok_s"] is None:
        del policy["recompute_tok_s"]  # added later: earlier runs keep their keys
    if isinstance(policy, dict):
        for name, default in (("disk_read_gbps", None), ("disk_latency_s", 0.0)):
            if name in policy and policy[name] == default:
                del policy[name]  # added with the disk tier: earlier runs keep their keys
    if isinstance(policy, dict) and policy.get("spread_by_load") is False:
        # a gateway knob (the simulator has no other clients' load to weigh): runs are
        # keyed as before it existed
        del policy["spread_by_load"]
    if isinstance(policy, dict) and policy.get("fill_idle") is False:
        del policy["fill_idle"]  # added later, off by default: earlier runs keep their keys
    if isinstance(policy, dict):
        for name, default in (("gpu_overcommit", 1.0), ("gpu_overcommit_max", 1.0),
                              ("gpu_overcommit_period_s", None)):
            if name in policy and policy[name] == default:
                del policy[name]  # added later: earlier runs keep their keys
    return out


OPTIONAL_SETTINGS: dict[str, Any] = {"reload_gbps": None, "acting_token_weight": 1.0,
                                     "acting_token_decay": False,
                                     "policy_reload_gbps": None,
                                     "max_wait_s": None, "recompute_tok_s": None,
                                     "disk_ratio": 0.0, "disk_kv_tokens": None,
                                     "disk": "nvme-gen5", "load_window_s": None,
                                     "max_output_tokens": None, "fill_idle": False,
                                     "gpu_overcommit": 1.0, "gpu_overcommit_max": 1.0}
"""Settings a record written before they existed lacks, with the value it meant."""

OPTIONAL_MEASURES: dict[str, Any] = {"disk_hit_rate": 0.0, "disk_read_tokens": 0,
                                     "disk_written_bytes": 0, "demotions_to_disk": 0,
                                     "disk_kv_capacity_tokens": 0}
"""Measurements a record written before they existed lacks, with the value a run of
that time had (no disk tier)."""


def _fields_dict(obj: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(obj))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = _fields_dict(value)
        elif hints[f.name] is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        out[f.name] = value
    return out


KEYED_AS: dict[str, str] = {"engine_slowdown": "time_scale"}
"""Settings hashed into a run's key under their former name, so that runs recorded
before the rename keep their keys (``SimConfig.engine_slowdown`` was ``time_scale``)."""


def _former_names(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a :func:`config_dict`) with the renamed settings under their former
    names (:data:`KEYED_AS`), as they are hashed into a run's key."""
    return {KEYED_AS.get(k, k): v for k, v in config.items()}


def _present_names(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded ``config`` with the renamed settings under their present names: the
    inverse of :func:`_former_names` (a record written before the rename has them so)."""
    former = {old: new for new, old in KEYED_AS.items()}
    return {former.get(k, k): v for k, v in config.items()}


def run_key(config: SimConfig, digest: str) -> str:
    """The stable key of one run: a hash of its config (renamed settings under their
    former names, :data:`KEYED_AS`), its trace set's digest and the simulator's
    ``MODEL_VERSION``."""
    payload = {"format": RECORD_FORMAT, "config": _former_names(config_dict(config)),
               "traces": digest, "model": MODEL_VERSION}
    return _sha256_json(payload)[:24]


def result_row(run: Run, result: RunResult) -> dict[str, Any]:
    """``result.to_dict()``: the run's settings (``programs`` in all and
    ``programs_per_replica``, which is ``run.programs_per_replica``) and measurements."""
    row = result.to_dict()
    assert row["programs_per_replica"] == run.programs_per_replica, "run and result differ"
    return row


def result_from_dict(data: dict[str, Any]) -> RunResult:
    """The inverse of ``RunResult.to_dict()`` (its nulls become NaN).

    The record's settings rebuild the run's :class:`SimConfig` (policy knobs a record
    does not carry take their defaults; ``max_context`` is the length programs were cut
    at, which gives the same run). Raises ``ValueError`` if the keys are not exactly
    those ``to_dict()`` writes, or the settings are not a valid configuration. A record
    written before ``programs_per_replica`` was a setting may lack that key (it is
    derived from ``programs`` and ``replicas``).
    """
    hints = typing.get_type_hints(RunResult)
    measured = set(hints) - set(RESULT_CONTEXT)
    data = _renamed_settings(data)
    data = {**OPTIONAL_SETTINGS, **OPTIONAL_MEASURES, **data}
    if set(data) | {_DERIVED} != measured | set(RESULT_SETTINGS):
        raise ValueError("the record's fields are not those of RunResult")
    values: dict[str, Any] = {}
    for name in measured:
        value = data[name]
        if hints[name] is float and value is None:
            value = math.nan
        elif hints[name] == list[float] and isinstance(value, list):
            value = [math.nan if v is None else v for v in value]
        values[name] = value
    policy_keys = {f.name for f in dataclasses.fields(PolicyConfig)}
    sim_keys = {f.name for f in dataclasses.fields(SimConfig)}
    knobs = {k: data[k] for k in RESULT_SETTINGS if k in policy_keys and k not in sim_keys}
    knobs.update({name: data[key] for key, name in _POLICY_SETTINGS.items()})
    config = SimConfig(**{k: data[k] for k in RESULT_SETTINGS if k in sim_keys},
                       policy_config=PolicyConfig(**knobs))
    if data.get(_DERIVED, config.programs_per_replica) != config.programs_per_replica:
        raise ValueError(f"the record's {_DERIVED} is not programs / replicas")
    return RunResult(config=config, traces=data["traces"], max_context=data["max_context"],
                     **values)


_DERIVED = "programs_per_replica"
"""The setting of a flat record that is not a :class:`SimConfig` field."""

_POLICY_SETTINGS = {"policy_reload_gbps": "reload_gbps"}
"""Settings of a flat record named apart from their :class:`PolicyConfig` field (the
field's name is a :class:`SimConfig` field's too)."""


def _renamed_settings(data: dict[str, Any]) -> dict[str, Any]:
    """A flat record with the settings' present names (the old name is still read, never
    written): one written before the engine's slowdown was named ``engine_slowdown`` has
    it as ``time_scale``."""
    if "time_scale" in data and "engine_slowdown" not in data:
        data = {("engine_slowdown" if k == "time_scale" else k): v for k, v in data.items()}
    return data


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("x", encoding="utf-8") as f:  # usual permissions, unlike mkstemp
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: object) -> None:
    """``obj`` as JSON (sorted keys, indent 2, no NaN), written atomically."""
    atomic_write_text(path, json.dumps(obj, sort_keys=True, indent=2, allow_nan=False) + "\n")


class RunStore:
    """The run records of one sweep output folder, for one trace set."""

    def __init__(self, out: Path, traces: TraceSet) -> None:
        self.out = out
        self.runs_dir = out / RUNS_DIR
        self.traces_name = traces.name
        self.digest = trace_digest(traces)

    def prepare(self) -> None:
        """Create the folders; remove temporary files a killed sweep left behind.

        A record is written in microseconds, so a temporary file older than a minute is
        not another sweep's write in progress.
        """
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.runs_dir.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > 60:
                    stale.unlink()

    def key(self, run: Run) -> str:
        """The run's key (see :func:`run_key`)."""
        return run_key(run.config, self.digest)

    def path(self, run: Run) -> Path:
        """Where the run's record lives."""
        return self.runs_dir / f"{self.key(run)}.json"

    def load(self, run: Run) -> RunResult | None:
        """The recorded result of ``run``, or None if there is no matching, readable record."""
        try:
            record = json.loads(self.path(run).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict):
            return None
        traces = record.get("traces")
        if (record.get("format") != RECORD_FORMAT or record.get("key") != self.key(run)
                or not isinstance(record.get("config"), dict)
                or _present_names(record["config"]) != config_dict(run.config)
                or not isinstance(traces, dict) or traces.get("sha256") != self.digest
                or not isinstance(record.get("result"), dict)):
            return None
        try:
            return result_from_dict(record["result"])
        except (TypeError, ValueError):
            return None

    def save(self, run: Run, result: RunResult) -> None:
        """Record ``run``'s result atomically (replacing any older record)."""
        record = {
            "format": RECORD_FORMAT, "key": self.key(run), "config": config_dict(run.config),
            "traces": {"name": self.traces_name, "sha256": self.digest},
            "programs_per_replica": run.programs_per_replica, "result": result.to_dict(),
        }
        write_json(self.path(run), record)


def write_setting(out: Path, stem: str, rows: list[dict[str, Any]]) -> Path:
    """One setting's rows (grid order) as ``out/<stem>.json``; returns the path."""
    path = out / f"{stem}.json"
    write_json(path, rows)
    return path


def write_sweep(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    """``out/sweep.json``: ``meta`` (name, traces, settings, ...) plus every run's row."""
    path = out / "sweep.json"
    write_json(path, {**meta, "runs": rows})
    return path
