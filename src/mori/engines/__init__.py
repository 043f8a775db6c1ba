"""Async adapters to engine replicas: real engines (vLLM, SGLang, any OpenAI-compatible
server) and the simulated engine. ``ADAPTERS`` (in ``mori.engines.registry``) lists them."""
