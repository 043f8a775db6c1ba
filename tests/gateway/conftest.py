from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_harness import LoopThread


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()
