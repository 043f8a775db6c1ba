"""Test helpers shared across the test directories: ``fake_engine`` (a scripted
OpenAI-compatible engine and a KV-event publisher), ``fake_plugin`` (the MORI vLLM
plug-in's end of the label channel), ``loop_thread`` (servers on an event loop in a
background thread, for tests that call them synchronously) and ``serve_process``
(``mori serve`` as a child process)."""
