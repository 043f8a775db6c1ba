"""Builders of TraceLab round rows, written from TraceLab's published schema (README
"Data format" and artifacts/utils/DB_SCHEMA.md), for the importer's tests."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

T0 = datetime(2026, 3, 21, 10, 0, 0, tzinfo=UTC).timestamp()


def iso(t: float) -> str:
    """POSIX seconds as TraceLab writes them: ISO-8601 UTC with milliseconds and ``Z``."""
    text = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


def tool(name: str, start: float, wall_ms: int | None, internal_ms: int | None = None,
         *, index: int = 0, call_id: str = "call_1", private: bool = False) -> dict[str, Any]:
    """A ``tools[]`` entry run from ``start`` (seconds after :data:`T0`)."""
    out: dict[str, Any] = {
        "tool_index": index, "tool_name": name, "tool_call_id": call_id,
        "emitted_at": iso(T0 + start),
        "result_at": iso(T0 + start + (wall_ms or 0) / 1000) if wall_ms is not None else None,
        "input_chars": 120, "result_chars": 300,
        "tool_wall_latency_ms": wall_ms, "tool_internal_latency_ms": internal_ms,
        "is_error": False,
    }
    if private:
        out["input"] = {"command": "ls"}
    return out


def row(provider: str, session: str, index: int, *, inputs: list[tuple[str, float]],
        outputs: list[tuple[str, float]], prompt: int, prefix: int, output: int = 100,
        tools: list[dict[str, Any]] | None = None, private: bool = False,
        **extra: Any) -> dict[str, Any]:
    """One round: ``inputs`` / ``outputs`` are (event type, seconds after :data:`T0`)."""
    events: list[dict[str, Any]] = []
    for kind, t in inputs:
        events.append({"event_type": kind, "timestamp": iso(T0 + t),
                       "source": "user.message" if kind == "user_message" else "tool_result"})
    for kind, t in outputs:
        events.append({"event_type": kind, "timestamp": iso(T0 + t), "source": "assistant"})
    claude = provider == "claude"
    out: dict[str, Any] = {
        "provider": provider, "project": "project_1", "session_id": session,
        "round_index": index, "round_id": f"{session}:{index}", "model": "m",
        "input_tokens_total": prompt, "prefix_tokens": prefix,
        "newly_append_tokens": prompt - prefix,
        "claude_uncached_input_tokens": 2 if claude else None,
        "claude_cache_creation_input_tokens": prompt - prefix - 2 if claude else None,
        "claude_cache_read_input_tokens": prefix if claude else None,
        "output_tokens": output, "reasoning_output_tokens": None if claude else 20,
        "timing_events": events, "tools": tools or [],
        "current_input_event_count": len(inputs), "first_input_event_type":
            inputs[0][0] if inputs else None,
        "store": ".claude" if claude else ".codex",
        "trace_key": f"{provider}:{session}:{index}",
    }
    if private:
        out["session_file"] = f"/home/u/.{provider}/{session}.jsonl"
        out["home"] = "/home/u"
        out["user"] = "u"
    out.update(extra)
    return out


def write_rows(path: Path, rows: list[dict[str, Any]], *, tail: str = "") -> Path:
    """``rows`` as JSON Lines at ``path`` (gzipped when it ends in ``.gz``), then
    ``tail`` verbatim (a torn line, say)."""
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    if path.name.endswith(".gz"):
        import gzip

        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def claude_session(session: str = "claude:s1", *, private: bool = False) -> list[dict[str, Any]]:
    """Three Claude rounds: a prompt; a Bash call of 5 s (internal 4.9 s); a person's
    next prompt 30 s after the second response."""
    return [
        row("claude", session, 0, inputs=[("user_message", 0.0)],
            outputs=[("reasoning", 2.0), ("text", 3.0), ("tool_call", 4.0)],
            prompt=20_000, prefix=15_000, private=private,
            tools=[tool("Bash", 4.0, 5000, 4900, private=private)]),
        row("claude", session, 1, inputs=[("tool_result", 9.0)],
            outputs=[("text", 12.0)], prompt=21_000, prefix=20_000, private=private),
        row("claude", session, 2, inputs=[("user_message", 42.0)],
            outputs=[("text", 45.0)], prompt=22_000, prefix=21_000, private=private),
    ]


def codex_session(session: str = "codex:c1") -> list[dict[str, Any]]:
    """Two Codex rounds: exec_command of 0.5 s wall with a 0 ms internal latency (the
    internal one wins), then a final answer; usage reports close each round."""
    return [
        row("codex", session, 0, inputs=[("user_message", 100.0)],
            outputs=[("reasoning", 101.0), ("tool_call", 102.0), ("usage_report", 102.5)],
            prompt=9_000, prefix=6_000,
            tools=[tool("exec_command", 102.0, 500, 0)]),
        row("codex", session, 1, inputs=[("tool_result", 102.5)],
            outputs=[("text", 104.0), ("usage_report", 104.1)], prompt=9_500, prefix=9_000),
    ]


def _naive(text: str | None) -> datetime | None:
    if text is None:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).replace(tzinfo=None)


def write_db(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a TraceLab DuckDB database (tables ``rounds``, ``tool_calls`` and
    ``timing_events`` with the columns of TraceLab's DB_SCHEMA.md; timestamps naive UTC)."""
    import duckdb

    con = duckdb.connect(str(path))
    con.execute(
        "CREATE TABLE rounds (round_pk BIGINT, ingest_seq BIGINT, provider VARCHAR, "
        "project VARCHAR, session_id VARCHAR, session_file VARCHAR, round_index BIGINT, "
        "round_id VARCHAR, model VARCHAR, input_tokens_total BIGINT, prefix_tokens BIGINT, "
        "newly_append_tokens BIGINT, claude_uncached_input_tokens BIGINT, "
        "claude_cache_creation_input_tokens BIGINT, claude_cache_read_input_tokens BIGINT, "
        "output_tokens BIGINT, reasoning_output_tokens BIGINT, trace_key VARCHAR)")
    con.execute(
        "CREATE TABLE tool_calls (round_pk BIGINT, tool_index BIGINT, tool_name VARCHAR, "
        "tool_call_id VARCHAR, emitted_at TIMESTAMP, result_at TIMESTAMP, "
        "tool_wall_latency_ms BIGINT, tool_internal_latency_ms BIGINT, is_error BOOLEAN, "
        "input_chars BIGINT, result_chars BIGINT)")
    con.execute(
        "CREATE TABLE timing_events (round_pk BIGINT, event_index BIGINT, "
        "event_type VARCHAR, source VARCHAR, timestamp TIMESTAMP, tool_call_id VARCHAR, "
        "tool_index BIGINT, tool_name VARCHAR, is_error BOOLEAN, result_chars BIGINT, "
        "content_chars BIGINT)")
    for pk, r in enumerate(rows):
        con.execute("INSERT INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                    "?, ?)",
                    [pk, pk, r["provider"], r.get("project"), r["session_id"],
                     r.get("session_file"), r.get("round_index"), r.get("round_id"),
                     r.get("model"), r.get("input_tokens_total"), r.get("prefix_tokens"),
                     r.get("newly_append_tokens"), r.get("claude_uncached_input_tokens"),
                     r.get("claude_cache_creation_input_tokens"),
                     r.get("claude_cache_read_input_tokens"), r.get("output_tokens"),
                     r.get("reasoning_output_tokens"), r.get("trace_key")])
        for index, t in enumerate(r["tools"]):
            con.execute("INSERT INTO tool_calls VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [pk, index, t["tool_name"], t["tool_call_id"], _naive(t["emitted_at"]),
                         _naive(t["result_at"]), t["tool_wall_latency_ms"],
                         t["tool_internal_latency_ms"], t["is_error"], t["input_chars"],
                         t["result_chars"]])
        for index, e in enumerate(r["timing_events"], 1):
            con.execute("INSERT INTO timing_events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        [pk, index, e["event_type"], e.get("source"), _naive(e["timestamp"]),
                         None, None, None, None, None, None])
    con.close()
    return path
