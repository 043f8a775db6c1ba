"""``mori replay``: the closed-loop trace replayer as a real OpenAI-compatible client.

``replay(config, traces)`` (async) runs one replay and returns a :class:`ReplayResult`;
the replay rules are the simulator's (:mod:`mori.sim.plan`).
"""

from mori.replay.client import ReplayProgress, replay
from mori.replay.config import ReplayConfig, ReplaySettingsError
from mori.replay.metrics import ReplayResult, RequestRecord
from mori.replay.target import TargetError

__all__ = ["ReplayConfig", "ReplayProgress", "ReplayResult", "ReplaySettingsError",
           "RequestRecord", "TargetError", "replay"]
