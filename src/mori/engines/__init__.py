"""Async adapters to engine replicas: real engines (vLLM, SGLang, any OpenAI-compatible
server) and the simulated engine's server (``mori.enginesim``). ``ADAPTERS`` (in
``mori.engines.registry``) lists them. Adapters only: no engine lives here."""
