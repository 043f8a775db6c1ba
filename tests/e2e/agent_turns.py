"""The scripted agents of the end-to-end tests: prompt text, and one model call of an
agent through the official ``openai`` client (its reply joins the history)."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["the", "agent", "reads", "a", "file", "then", "runs", "the", "tests", "and", "edits", "the", "code", "until", "the", "build", "passes", "while", "another", "program", "waits", "for", "its", "tool", "call"]


def text(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def turn_of(client: Any, pid: str, turn: int, messages: list[dict[str, str]],
            max_tokens: int = 48) -> dict[str, Any]:
    """One model call of an agent; its reply joins ``messages``."""
    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0.0,
        extra_body={"program_id": pid})
    reply = resp.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": reply})
    details = resp.usage.prompt_tokens_details if resp.usage else None
    return {"program": pid, "turn": turn, "text": reply,
            "prompt_tokens": resp.usage.prompt_tokens if resp.usage else 0,
            "completion": resp.usage.completion_tokens if resp.usage else 0,
            "cached": (details.cached_tokens or 0) if details else 0}
