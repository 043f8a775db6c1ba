"""The simulated engine served over HTTP (``mori engine-sim``): an OpenAI- and
Anthropic-compatible server with MORI's KV controls around one
``mori.sim.realtime.RealtimeReplica``.

- ``server``: the Starlette app, its endpoints, ``start_engine_sim``.
- ``calls``: reading a request of any API into a ``Call``.
- ``answers``: what is answered (placeholder text, or a script's text and tool calls).
- ``streams``: a stream paced by the engine, the wait for a whole answer, SSE framing.
- ``completions``, ``messages``, ``responses``: each API's answer body and stream (and
  Anthropic's error shape).
- ``metrics``: the Prometheus collector (``mori_engine_*``).

The scripts (``mori.sim.script``) are re-exported here for the layers above.
"""

from mori.enginesim.server import (
    EngineSimServer,
    create_engine_sim_app,
    start_engine_sim,
)
from mori.sim.realtime import EngineSimConfig
from mori.sim.script import (
    Script,
    ScriptError,
    ScriptStep,
    ScriptTool,
    load_script,
    parse_script,
    script_from_trace,
)

__all__ = ["EngineSimConfig", "EngineSimServer", "Script", "ScriptError", "ScriptStep",
           "ScriptTool", "create_engine_sim_app", "load_script", "parse_script",
           "script_from_trace", "start_engine_sim"]
