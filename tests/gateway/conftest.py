from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_harness import LoopThread
from through_workers import VIA


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(params=VIA)
def via(request: pytest.FixtureRequest) -> str:
    """Who serves the test's connections: the policy process, or a worker
    (``through_workers``)."""
    name: str = request.param
    return name
