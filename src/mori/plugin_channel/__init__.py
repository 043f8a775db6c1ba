"""The label channel between the gateway and MORI's plug-ins inside the engines: its
messages (``protocol``), the engine's end of it (``server``, a ZMQ ROUTER on a thread)
and the table of labels the plug-ins evict by (``labels``). Used by both plug-ins
(``mori.vllm_plugin``, ``mori.sglang_plugin``); the gateway's end is
``mori.engines.label_channel``. Needs neither engine (the server needs pyzmq).
"""
