"""MORI inside vLLM: typed eviction driven by the gateway's labels.

Only ``scheduler``, ``cpu_tier`` and ``host_tier`` import vLLM; they are imported inside
vLLM's own processes (``--scheduler-cls mori.vllm_plugin.scheduler.MoriScheduler``, see
``mori vllm-args``; ``cpu_tier``, the host tier's cache policy, and ``host_tier``, the CPU
build's copy worker and offloading spec, through ``--kv-transfer-config``, see
``connector_config.kv_transfer_config``).
``typed_queue`` and ``connector_config`` need no vLLM, so ``mori vllm-args`` prints the
flags and the tests exercise the queue anywhere. The label channel (its messages, its
server and the label table) is ``mori.plugin_channel``, shared with the SGLang plug-in.
"""
