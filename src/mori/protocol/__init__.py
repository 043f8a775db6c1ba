"""The OpenAI-compatible protocol as MORI speaks it, in one place for the gateway, the
simulated engine's server (``mori.enginesim``), the sim adapter and the replay client.

- ``fields``: the request paths and MORI's own request fields (``program_id``, ``mori``).
- ``tokens``: prompt sizes without a tokenizer (``CHARS_PER_TOKEN``).
- ``errors``: OpenAI-style error bodies and ``RequestError`` (no HTTP library imported).
- ``responses``: the Starlette responses: an error, an SSE event stream.
- ``serve``: serving an ASGI app with uvicorn in the running event loop.

It builds on ``mori.core`` only (and Starlette, uvicorn); nothing is imported here, so
that ``fields``, ``tokens`` and ``errors`` stay free of HTTP libraries.
"""
