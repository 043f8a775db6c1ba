"""The gateway tests' harness: servers run on an event loop in a background thread, tests
use the official (synchronous) ``openai`` client and plain HTTP from the test thread.

The pieces are shared with the other test directories (``tests/support``): the loop
thread, the fake engine, and ``Running``, a served app (``mori.protocol.serve``).
"""

from __future__ import annotations

from mori.protocol.serve import RunningServer as Running
from support.fake_engine import FakeEngine
from support.loop_thread import LoopThread

__all__ = ["FakeEngine", "LoopThread", "Running"]
