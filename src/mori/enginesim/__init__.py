"""The simulated engine served over HTTP (``mori engine-sim``): an OpenAI-compatible
server with MORI's KV controls around one ``mori.sim.realtime.RealtimeReplica``.

- ``server``: the Starlette app, its endpoints, ``start_engine_sim``.
- ``completions``: reading a completion request, writing its answer or stream.
- ``metrics``: the Prometheus collector (``mori_engine_*``).
"""

from mori.enginesim.server import (
    EngineSimServer,
    create_engine_sim_app,
    start_engine_sim,
)
from mori.sim.realtime import EngineSimConfig

__all__ = ["EngineSimConfig", "EngineSimServer", "create_engine_sim_app", "start_engine_sim"]
