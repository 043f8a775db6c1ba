"""MORI inside vLLM: typed eviction driven by the gateway's labels.

The modules that import vLLM (``scheduler``, ``typed_queue``, ``server``) are imported only
inside vLLM's own processes (``--scheduler-cls mori.vllm_plugin.scheduler.MoriScheduler``);
this package and ``protocol`` import without vLLM, so the gateway's adapter can speak the
label channel's protocol.
"""
