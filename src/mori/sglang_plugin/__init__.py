"""MORI inside SGLang: a radix-cache backend that evicts in MORI's order.

``backend`` imports SGLang and runs inside SGLang's processes: it registers the radix
cache backend ``mori`` (``--radix-cache-backend mori``, through the entry point
``mori`` of the group ``sglang.srt.plugins``, loaded by SGLang at start), whose tree
nodes remember the programs whose requests inserted or matched them and whose eviction
takes, on the GPU, unowned pages first, then the inactive programs', the idle, the busy
(least recently used first within each); on HiCache's host tier, unowned, inactive,
busy, then idle. ``order`` (the order itself) needs no SGLang, so the gateway, ``mori
sglang-args`` and the tests read it anywhere. The labels come over the same channel as
the vLLM plug-in's (``mori.plugin_channel``: its messages, server and label table).
"""
