"""MORI inside vLLM: typed eviction driven by the gateway's labels.

Only ``scheduler`` imports vLLM; it is imported inside vLLM's own processes
(``--scheduler-cls mori.vllm_plugin.scheduler.MoriScheduler``, see ``mori vllm-args``).
``protocol`` (the label channel's messages), ``labels`` and ``typed_queue`` need no vLLM,
so the gateway's adapter speaks the protocol and the tests exercise the queue anywhere.
"""
