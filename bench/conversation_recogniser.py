"""The conversation recogniser's cost: time per request and memory at 10k programs, against
the explicit ``program_id`` path in the same run.

Builds ``--programs`` chat conversations (a shared system prompt and tools, a first user
message of their own, then ``--turns`` shared turns: assistant tool calls and tool results
of ``--turn-bytes`` each), brings every one into the conversation index at its
``--turns``-th request, then times ``--sample`` requests that each continue one of them
(one more answer and tool result) through ``mori.gateway.identity.recognise`` twice: with
the conversation index (the request names nothing) and with an explicit ``program_id``
(the same body, the index not consulted). Also times ``json.loads`` of the same bodies:
what every request already pays to be parsed. Memory: the Python allocations the index
holds after all programs are in (``tracemalloc``), per program.

    python bench/conversation_recogniser.py [--programs 10000] [--turns 40]
                                            [--turn-bytes 400] [--sample 2000]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc
from typing import Any

from mori.gateway.conversations import ConversationIndex
from mori.gateway.identity import DEFAULT_ORDER, Seen, recognise
from mori.protocol.apis import API_BY_PATH
from mori.protocol.fields import CHAT

SPEC = API_BY_PATH[CHAT]
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"the {name} tool " * 20,
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}
    for name in ("bash", "edit", "view", "search")]


def shared_turns(turns: int, turn_bytes: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(0, turns, 2):
        call = f"call_{i}"
        out.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call, "type": "function",
             "function": {"name": "bash", "arguments": json.dumps(
                 {"command": "x" * max(1, turn_bytes // 4)})}}]})
        out.append({"role": "tool", "tool_call_id": call, "content": "y" * turn_bytes})
    return out[:turns]


def body(system: dict[str, Any], user: str, turns: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "tools": TOOLS,
            "messages": [system, {"role": "user", "content": user}, *turns]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=10_000)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--turn-bytes", type=int, default=400)
    ap.add_argument("--sample", type=int, default=2000)
    a = ap.parse_args()
    system = {"role": "system", "content": "You are a software engineering agent. " * 100}
    turns = shared_turns(a.turns + 2, a.turn_bytes)
    users = [f"task {i}: fix the failing test in module_{i}.py" for i in range(a.programs)]
    idx = ConversationIndex(idle_s=0, max_programs=a.programs * 2)

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    for u in users:
        idx.program(SPEC, body(system, u, turns[:a.turns]))
    fill_s = time.perf_counter() - t0
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(idx) == a.programs

    rng = random.Random(7)
    chosen = rng.sample(range(a.programs), min(a.sample, a.programs))
    nexts = [body(system, users[i], turns[:a.turns + 2]) for i in chosen]
    raw = [json.dumps(b) for b in nexts]
    request_bytes = sum(len(r) for r in raw) / len(raw)

    t0 = time.perf_counter()
    for r in raw:
        json.loads(r)
    parse_s = (time.perf_counter() - t0) / len(raw)

    t0 = time.perf_counter()
    named = [recognise(DEFAULT_ORDER, SPEC, Seen({}, {**b, "program_id": f"p{i}"}, f"p{i}",
                                                 SPEC, idx)) for i, b in enumerate(nexts)]
    explicit_s = (time.perf_counter() - t0) / len(nexts)
    assert all(r.recogniser == "program-id" for r in named)

    t0 = time.perf_counter()
    found = [recognise(DEFAULT_ORDER, SPEC, Seen({}, b, None, SPEC, idx)) for b in nexts]
    conv_s = (time.perf_counter() - t0) / len(nexts)
    assert all(r.recogniser == "conversation" for r in found)
    assert len(idx) == a.programs, "a continuation started a new program"

    print(json.dumps({
        "programs": a.programs, "messages_per_request": a.turns + 4,
        "request_bytes": round(request_bytes),
        "index_bytes": held, "bytes_per_program": round(held / a.programs, 1),
        "fill_s": round(fill_s, 3),
        "explicit_us_per_request": round(explicit_s * 1e6, 2),
        "conversation_us_per_request": round(conv_s * 1e6, 2),
        "json_parse_us_per_request": round(parse_s * 1e6, 2),
        "conversation_over_explicit": round(conv_s / explicit_s, 1),
        "conversation_over_parse": round(conv_s / parse_s, 2),
    }, indent=2))


if __name__ == "__main__":
    main()
