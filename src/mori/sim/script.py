"""Scripted answers for the simulated engine: what it says, and which tools it calls.

A script makes ``mori engine-sim`` drive a real agent (Claude Code, Codex, any loop on
the chat API) through a fixed sequence of tool calls, so that the agent's own tool time
and request pattern can be measured against the simulated engine. The file is JSON (or
TOML, by its ``.toml`` suffix)::

    {"steps": [
       {"text": "Listing the files.",
        "tool": {"Bash": {"command": "sleep 2 && ls", "description": "List files"},
                 "shell": {"command": ["bash", "-lc", "sleep 2 && ls"]},
                 "exec_command": {"cmd": "sleep 2 && ls"}}},
       {"text": "Done."}],
     "fallback": "OK."}

- ``steps`` (a non-empty array): each step has an optional ``text`` (said before the
  call, or the whole answer) and an optional ``tool``: tool names mapped to the call's
  input (an object), in order of preference: the answer calls the first of those names
  that the request offers (agents name their shell tool differently: Claude Code
  ``Bash``, Codex ``shell`` or ``exec_command``, Gemini CLI ``run_shell_command``). A
  step needs a text or a tool.
  ``requires`` (optional): tool names the step calls a tool only for requests that offer
  every one of, e.g. ``["ScheduleWakeup"]`` to have Claude Code's main agent, and not its
  subagents (which are offered the ``Agent`` tool too, without that one), start a
  subagent; or an object mapping some of the step's tools to the names each requires
  (``{"Agent": ["ScheduleWakeup"]}``: the main agent calls ``Agent``, a subagent the
  step's next tool it offers, such as ``Bash``). A Responses request's tools inside a
  ``namespace`` tool (Codex's ``multi_agent_v1``: ``spawn_agent``, ``wait_agent``, ...)
  are named bare or as ``namespace.name``; the call carries the namespace. A string of
  a tool's input that is exactly ``{{result.NAME}}`` becomes field ``NAME`` of the JSON
  object the request's last tool result holds (Codex's ``spawn_agent`` answers
  ``{"agent_id": ..., "nickname": ...}``, so ``{"wait_agent": {"targets":
  ["{{result.agent_id}}"]}}`` waits on the agent the previous step spawned).
- ``fallback`` (optional, default ``DEFAULT_FALLBACK``): the text for what the script
  does not cover.

Which step a request is at (``mori.enginesim.answers`` reads it from the request): the
number of tool results in its conversation after its last prompt (a user message that
carries no tool result and is no notification of background work, such as Claude Code's
``<task-notification>`` when a background subagent ends), so each new prompt starts the
script again, and a notification goes on where the script was. At step k < the
number of steps, a request that offers one of step k's tools gets its text and that call;
one that offers tools but none of step k's gets step k's text alone (the fallback if it
has none); past the last step, the last step's text ends the turn (the fallback if it
has none). A request that offers no tool at all (an agent's side requests: titles,
summaries) gets the fallback.

``script_from_trace`` makes a script from a recorded program: each step whose gap is a
tool call becomes a step calling ``sleep <gap_s>`` on the shell tools, so an agent run
against it spends the recorded tool time.

This module holds the data only (no HTTP): ``Script``, ``ScriptStep``, ``ScriptTool``,
``parse_script``, ``load_script``, ``script_from_trace``; ``ScriptError`` names the
file and the field at fault.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mori.traces.model import GapKind, ProgramTrace

DEFAULT_FALLBACK = "OK."
"""The text for what a script does not cover, unless it says otherwise."""
SHELL_TOOLS = ("Bash", "shell", "exec_command", "run_shell_command")
"""The shell tools of Claude Code (``Bash``), Codex (``shell``, ``exec_command``) and
Gemini CLI (``run_shell_command``)."""


class ScriptError(ValueError):
    """A script that cannot be read: ``str()`` names the source, the field and the fault."""

    def __init__(self, source: str, where: str | None, problem: str) -> None:
        self.source = source
        self.where = where
        self.problem = problem
        super().__init__(": ".join(p for p in (source, where, problem) if p))


@dataclass(frozen=True, slots=True)
class ScriptTool:
    """One tool a step may call: its name, its input as compact JSON (an object), and the
    tools a request must offer for it to be called (``requires``)."""

    name: str
    arguments: str
    requires: tuple[str, ...] = ()

    @property
    def input(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.arguments)
        return value

    def filled(self, result: str | None) -> ScriptTool:
        """This tool with each ``{{result.NAME}}`` string of its input replaced by field
        ``NAME`` of the JSON object ``result`` (the request's last tool result) holds; a
        field it lacks (or a result that is no JSON object) leaves the string as it is."""
        if RESULT_MARK not in self.arguments or result is None:
            return self
        try:
            fields = json.loads(result)
        except ValueError:
            return self
        if not isinstance(fields, dict):
            return self
        return replace(self, arguments=_compact(_fill(self.input, fields)))


@dataclass(frozen=True, slots=True)
class ScriptStep:
    """One answer of the script: ``text``, and the tools it may call (first offered wins)."""

    text: str = ""
    tools: tuple[ScriptTool, ...] = ()
    requires: tuple[str, ...] = ()

    def tool_for(self, offered: Sequence[str]) -> ScriptTool | None:
        """The first of this step's tools that the request offers, and every tool that
        tool requires, if any (none unless it offers every tool of ``requires``)."""
        if any(name not in offered for name in self.requires):
            return None
        return next((t for t in self.tools if t.name in offered
                     and all(r in offered for r in t.requires)), None)


@dataclass(frozen=True, slots=True)
class Script:
    """A scripted conversation (see the module doc)."""

    steps: tuple[ScriptStep, ...]
    fallback: str = DEFAULT_FALLBACK

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError("a script needs at least one step")
        if not self.fallback:
            raise ValueError("a script's fallback text must not be empty")

    @property
    def final_text(self) -> str:
        """What ends the turn past the last step: its text, else the fallback."""
        return self.steps[-1].text or self.fallback


RESULT_MARK = "{{result."
_RESULT_FIELD = re.compile(r"\{\{result\.([^{}]+)\}\}")


def _fill(value: Any, fields: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        m = _RESULT_FIELD.fullmatch(value)
        return fields[m.group(1)] if m is not None and m.group(1) in fields else value
    if isinstance(value, list):
        return [_fill(v, fields) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, fields) for k, v in value.items()}
    return value


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _type_name(value: object) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "an integer", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _parse_tools(raw: object, source: str, where: str) -> tuple[ScriptTool, ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise ScriptError(source, where, "must be a non-empty object mapping tool names to "
                          f"their input, not {_type_name(raw)}")
    tools = []
    for name, tool_input in raw.items():
        if not name:
            raise ScriptError(source, where, "a tool name must not be empty")
        if not isinstance(tool_input, Mapping):
            raise ScriptError(source, f"{where}.{name}", "the tool's input must be an "
                              f"object, not {_type_name(tool_input)}")
        tools.append(ScriptTool(str(name), _compact(tool_input)))
    return tuple(tools)


def _parse_step(raw: object, source: str, where: str) -> ScriptStep:
    if not isinstance(raw, Mapping):
        raise ScriptError(source, where, f"a step must be an object, not {_type_name(raw)}")
    unknown = sorted(set(raw) - {"text", "tool", "requires"})
    if unknown:
        raise ScriptError(source, where, f"unknown field {unknown[0]!r} (a step has 'text', "
                          "'tool' and 'requires')")
    text = raw.get("text", "")
    if not isinstance(text, str):
        raise ScriptError(source, where + ".text", f"must be a string, not {_type_name(text)}")
    tools = () if raw.get("tool") is None else _parse_tools(raw["tool"], source,
                                                            where + ".tool")
    if not text and not tools:
        raise ScriptError(source, where, "a step needs a 'text' or a 'tool'")
    requires = raw.get("requires", [])
    if isinstance(requires, Mapping):
        names = {t.name for t in tools}
        for name, needs in requires.items():
            if name not in names:
                raise ScriptError(source, f"{where}.requires.{name}", "names no tool of "
                                  "the step's 'tool'")
            _check_names(needs, source, f"{where}.requires.{name}")
        tools = tuple(replace(t, requires=tuple(requires.get(t.name, ()))) for t in tools)
        return ScriptStep(text, tools)
    _check_names(requires, source, where + ".requires")
    return ScriptStep(text, tools, tuple(requires))


def _check_names(raw: object, source: str, where: str) -> None:
    if not isinstance(raw, list) or not all(isinstance(r, str) and r for r in raw):
        also = (", or an object mapping the step's tools to such arrays"
                if where.endswith(".requires") else "")
        raise ScriptError(source, where, "must be an array of tool names" + also)


def parse_script(raw: object, source: str = "<script>") -> Script:
    """A script from its parsed JSON (see the module doc); ``ScriptError`` naming
    ``source`` and the field otherwise."""
    if not isinstance(raw, Mapping):
        raise ScriptError(source, None, "a script must be an object with 'steps', not "
                          + _type_name(raw))
    unknown = sorted(set(raw) - {"steps", "fallback"})
    if unknown:
        raise ScriptError(source, None, f"unknown field {unknown[0]!r} (a script has "
                          "'steps' and 'fallback')")
    steps = raw.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ScriptError(source, "steps", "must be a non-empty array of steps, not "
                          + ("an empty array" if steps == [] else _type_name(steps)))
    fallback = raw.get("fallback", DEFAULT_FALLBACK)
    if not isinstance(fallback, str) or not fallback:
        raise ScriptError(source, "fallback", "must be a non-empty string")
    return Script(tuple(_parse_step(s, source, f"steps[{i}]") for i, s in enumerate(steps)),
                  fallback)


def load_script(path: str | os.PathLike[str]) -> Script:
    """Read a script file: TOML if it ends in ``.toml``, else JSON. ``ScriptError`` for a
    file that cannot be read or parsed, or that is no script (the message says where)."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ScriptError(source, None, f"cannot read it: {e.strerror or e}") from None
    try:
        if source.lower().endswith(".toml"):
            raw: object = tomllib.loads(data.decode("utf-8"))
        else:
            raw = json.loads(data)
    except UnicodeDecodeError:
        raise ScriptError(source, None, "not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ScriptError(source, f"line {e.lineno} column {e.colno}",
                          f"invalid JSON: {e.msg}") from None
    except tomllib.TOMLDecodeError as e:
        raise ScriptError(source, None, f"invalid TOML: {e}") from None
    return parse_script(raw, source)


def _seconds(gap_s: float) -> str:
    """``gap_s`` as ``sleep`` takes it: plain decimal, to the millisecond."""
    return f"{gap_s:.3f}".rstrip("0").rstrip(".") or "0"


def sleep_inputs(gap_s: float, tool_names: Sequence[str] = SHELL_TOOLS) -> tuple[ScriptTool, ...]:
    """The calls that run ``sleep gap_s`` on each of ``tool_names``, in the input shape
    of the agent that names its shell so (``Bash``: ``{"command", "description"}``,
    ``shell``: ``{"command": ["bash", "-lc", ...]}``, ``exec_command``: ``{"cmd"}``,
    ``run_shell_command``: ``{"command", "description"}``; any other name:
    ``{"command": ...}``)."""
    command = f"sleep {_seconds(gap_s)}"
    shapes: dict[str, dict[str, Any]] = {
        "Bash": {"command": command, "description": "Wait as the recorded tool call did"},
        "shell": {"command": ["bash", "-lc", command]},
        "exec_command": {"cmd": command},
        "run_shell_command": {"command": command,
                              "description": "Wait as the recorded tool call did"},
    }
    return tuple(ScriptTool(name, _compact(shapes.get(name, {"command": command})))
                 for name in tool_names)


def script_from_trace(program: ProgramTrace, tool_names: Sequence[str] = SHELL_TOOLS,
                      final_text: str = "Done.") -> Script:
    """A script replaying ``program``'s tool time: one step per step of the program whose
    gap is a tool call (``GapKind.TOOL``), calling ``sleep <gap_s>`` on ``tool_names``,
    then ``final_text``. Gaps of other kinds (a person's turn, subagents) are left out:
    the script covers one prompt's run of tool calls."""
    if not tool_names:
        raise ValueError("tool_names must name at least one tool")
    steps = [ScriptStep(f"Step {i + 1}.", sleep_inputs(s.gap_s, tool_names))
             for i, s in enumerate(program.steps) if s.gap_kind == GapKind.TOOL]
    return Script((*steps, ScriptStep(final_text or DEFAULT_FALLBACK)))
