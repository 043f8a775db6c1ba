"""A Claude Code 2.1.15x transcript for the tests: ``tool_heavy.jsonl`` of the sample
project with the bookkeeping line types newer versions write (``permission-mode``,
``mode``, ``ai-title``, ``attachment``) interleaved, optionally without ``requestId``.

Test modules in this folder import it as ``claude_code_newer`` (pytest puts the folder
on ``sys.path``).
"""

from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data" / "claude-code"
SESSION_ID = "d6e0bada-1959-4eec-a9d2-0bfade768d8f"  # tool_heavy.jsonl's session


def _newer_lines() -> dict[int, list[dict[str, object]]]:
    """Lines of the four newer types, keyed by the tool_heavy.jsonl line they precede
    in the file, as 2.1.15x writes them: a permission-mode line first, mode changes, an
    ai-title once the session has a topic, attachments (hook context) before prompts."""
    def line(kind: str, **fields: object) -> dict[str, object]:
        return {"type": kind, **fields, "sessionId": SESSION_ID}

    attachment = {"parentUuid": None, "isSidechain": False, "userType": "external",
                  "timestamp": "2026-02-10T22:57:40.001Z", "uuid": "att-1",
                  "attachment": {"type": "hook_additional_context", "content": ["ok"],
                                 "hookName": "SessionStart", "toolUseID": "SessionStart"}}
    return {
        1: [line("permission-mode", permissionMode="default"),
            line("mode", mode="normal")],
        4: [line("attachment", **attachment)],
        12: [line("ai-title", aiTitle="Look up the weather")],
        20: [line("mode", mode="plan"),
             line("attachment", **{**attachment, "uuid": "att-2",
                                   "timestamp": "2026-02-10T22:59:22.000Z"})],
    }


NEWER_COUNTS = {"ai-title": 1, "attachment": 2, "mode": 2, "permission-mode": 1}
NEWER_SUMMARY = ("skipped 6 lines of unknown types: ai-title 1, attachment 2, mode 2, "
                 "permission-mode 1")


def newer_transcript(folder: Path, strip_request_id: bool = False) -> Path:
    """tool_heavy.jsonl as a 2.1.15x transcript in ``folder`` (the lines of
    :func:`_newer_lines` interleaved), optionally without any ``requestId``."""
    folder.mkdir(parents=True, exist_ok=True)
    extra = _newer_lines()
    out: list[str] = []
    lines = (DATA / "tool_heavy.jsonl").read_text().splitlines()
    for number, raw in enumerate(lines, 1):
        out.extend(json.dumps(obj) for obj in extra.get(number, []))
        obj = json.loads(raw)
        if strip_request_id:
            obj.pop("requestId", None)
        out.append(json.dumps(obj))
    file = folder / "tool_heavy.jsonl"
    file.write_text("\n".join(out) + "\n")
    return file
