"""Loader for the kv-cache-tester JSON trace format (callanjfox/kv-cache-tester).

One file is one conversation: ``{"id", "block_size", "tool_tokens", "system_tokens",
"requests": [...]}``; ``requests`` holds, in time order, LLM calls (``t``, ``in``, ``out``,
``hash_ids``, ``stop``, optional ``api_time`` and ``think_time``) and subagents
(``type: "subagent"``, ``t``, ``agent_id``, ``duration_ms`` and their own ``requests``).
Format reference: upstream ``docs/trace_replay_tester.md`` and the project data README.

Conversion rules (one LLM call -> one :class:`~mori.traces.model.Step`):

* ``prompt_tokens = in``, ``output_tokens = out``.
* ``reuse_tokens``: number of leading equal ``hash_ids`` entries shared with the previous
  LLM call of the same program, times ``block_size`` (default 64), capped at
  ``prompt_tokens``; 0 for a program's first call and for a call without ``hash_ids``.
  The hash lists themselves are kept (``Step.block_hashes``, ``ProgramTrace.block_size``)
  only when asked (``keep_hashes=True``); otherwise they are only compared.
* ``call_s = api_time`` when present (the provider's latency), else unknown.
* Gap after call *i*, when call *i+1* follows with no subagent in between:
  ``think_time`` of call *i+1* if present, capped at ``t[i+1] - t[i]``; else
  ``t[i+1] - t[i] - api_time[i]`` if ``api_time[i]`` is present; else ``t[i+1] - t[i]``;
  never negative. (The cap is ours: after a call without ``api_time`` -- an unfinished
  stream -- upstream measures ``think_time`` from the last *finished* response, so it can
  exceed the interval between the two requests, which no gap can.)
  Kind: ``TOOL`` if ``stop == "tool_use"``, else ``HUMAN``.
* Subagent entries after call *i* become :class:`SubagentSpawn` s of step *i*, in file
  order, named ``f"{parent}/{agent_id}"`` (``agent_id`` missing: ``f"{parent}/#{index}"``, its
  position in the parent's ``requests``)
  with ``delay_s = max(0, t_sub - (t[i] + api_time[i]))`` (``api_time`` missing: 0).
  The step's kind is ``SUBAGENT`` and its gap the residual
  ``max(0, t[i+1] - max(t_sub + duration_ms / 1000))`` over its subagents (0 for the last
  call: the program ends when its subagents do). A subagent's duration without
  ``duration_ms`` is the span of its own calls (first ``t`` to last ``t + api_time``).
  Each subagent is converted by the same rules, its reuse computed within its own
  ``requests`` (it shares the parent's hash namespace, but not its cache position);
  its ``shared_prefix_tokens`` is its own ``tool_tokens + system_tokens`` if given, else 0.
  A subagent with no LLM call at all is dropped (its time stays in the parent's gap);
  a subagent before its program's first LLM call is a :class:`TraceError`: the model
  can only spawn during the gap after a step.
* The last call's gap is 0, kind ``END`` (``SUBAGENT`` if subagents follow it).
* ``ProgramTrace.name = id`` (or the file stem), ``shared_prefix_tokens = tool_tokens +
  system_tokens`` (0 if absent), ``source`` = the path as given.

Malformed input (bad JSON, missing or mistyped fields, negative numbers, a trace without
LLM calls) raises :class:`~mori.traces.errors.TraceError` naming file and field path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mori.traces.errors import Fields, TraceError
from mori.traces.model import GapKind, ProgramTrace, Step, SubagentSpawn, TraceSet, block_hashes

DEFAULT_BLOCK_SIZE = 64


@dataclass(slots=True)
class _Sub:
    """A parsed subagent: spawn time (parent's clock), end time, and its program."""

    t: float
    end: float
    program: ProgramTrace


@dataclass(slots=True)
class _Call:
    """A parsed LLM call, before its gap is known."""

    t: float
    api_time: float | None
    think_time: float | None
    prompt: int
    output: int
    reuse: int
    stop: str
    hashes: Sequence[int] | None = None
    subs: list[_Sub] = field(default_factory=list)

    @property
    def end(self) -> float:
        """The response's end, as far as the trace tells (``t`` without ``api_time``)."""
        return self.t + (self.api_time or 0.0)


@dataclass(slots=True)
class _Context:
    """What every level of one file's parse needs."""

    file: str
    block_size: int
    keep_hashes: bool = False


def load_kvcache_tester_file(
    path: str | os.PathLike[str], *, keep_hashes: bool = False
) -> ProgramTrace:
    """Load one kv-cache-tester ``.json`` trace as a top-level program (rules: module doc).

    ``keep_hashes``: keep each call's ``hash_ids`` as ``Step.block_hashes``.

    Raises :class:`TraceError` (naming the file and the line/column or field path) for an
    unreadable file, invalid JSON, or content that does not follow the format.
    """
    file = os.fspath(path)
    try:
        data = Path(file).read_bytes()
    except OSError as exc:
        raise TraceError(file, None, f"cannot read file: {exc.strerror or exc}") from exc
    try:
        root = json.loads(data)
    except json.JSONDecodeError as exc:
        raise TraceError(
            file, f"line {exc.lineno}, column {exc.colno}", f"invalid JSON: {exc.msg}"
        ) from exc
    except ValueError as exc:  # undecodable bytes
        raise TraceError(file, None, f"not a UTF-8 JSON text: {exc}") from exc
    del data
    top = Fields(root, file, "")
    block_size = top.integer("block_size", DEFAULT_BLOCK_SIZE)
    if block_size == 0:
        raise top.error("must be positive", "block_size")
    ctx = _Context(file, block_size, keep_hashes)
    name = top.text("id", Path(file).stem) or Path(file).stem
    shared = top.integer("tool_tokens", 0) + top.integer("system_tokens", 0)
    program = _parse_program(top, ctx, name, shared)
    if program is None:
        raise top.error(
            "no LLM request in the trace", "requests", "a trace needs at least one LLM call"
        )
    return program


def load_kvcache_tester_dir(
    path: str | os.PathLike[str], *, keep_hashes: bool = False
) -> TraceSet:
    """Load every ``*.json`` file of a directory (sorted by name) as one :class:`TraceSet`.

    The set is named after the directory. Raises :class:`TraceError` if the directory
    cannot be listed, holds no ``*.json`` file, or any file is malformed.
    """
    directory = Path(path)
    try:
        files = sorted(p for p in directory.iterdir() if p.suffix == ".json" and p.is_file())
    except OSError as exc:
        raise TraceError(path, None, f"cannot list directory: {exc.strerror or exc}") from exc
    if not files:
        raise TraceError(path, None, "no *.json trace file in this directory")
    programs = tuple(load_kvcache_tester_file(p, keep_hashes=keep_hashes) for p in files)
    return TraceSet(name=directory.resolve().name, programs=programs)


def _common_prefix(a: list[object], b: list[object]) -> int:
    """The number of leading equal entries of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _parse_program(
    owner: Fields, ctx: _Context, name: str, shared_prefix: int
) -> ProgramTrace | None:
    """Convert ``owner.requests`` to a program; ``None`` if it has no LLM call."""
    requests = owner.array("requests")
    calls: list[_Call] = []
    prev_hashes: list[object] | None = None
    for index, raw in enumerate(requests):
        req = owner.child(raw, f"{owner.path('requests')}[{index}]")
        if req.opt_text("type") == "subagent":
            sub = _parse_subagent(req, ctx, name, index)
            if sub is None:
                continue
            if not calls:
                raise req.error(
                    "subagent before the first LLM call of its program",
                    hint="a subagent is spawned during the gap after one of its parent's "
                    "calls; move it after the call that spawned it",
                )
            calls[-1].subs.append(sub)
            continue
        prompt = req.integer("in")
        hashes = req.array("hash_ids", [])
        reuse = 0
        if prev_hashes is not None:
            reuse = min(prompt, _common_prefix(prev_hashes, hashes) * ctx.block_size)
        prev_hashes = hashes
        kept = _hash_tuple(req, hashes) if ctx.keep_hashes and req.has("hash_ids") else None
        calls.append(
            _Call(
                t=req.number("t"),
                api_time=req.opt_number("api_time"),
                think_time=req.opt_number("think_time"),
                prompt=prompt,
                output=req.integer("out"),
                reuse=reuse,
                stop=req.text("stop", ""),
                hashes=kept,
            )
        )
    if not calls:
        return None
    steps = tuple(
        _make_step(call, calls[i + 1] if i + 1 < len(calls) else None)
        for i, call in enumerate(calls)
    )
    has_hashes = any(step.block_hashes is not None for step in steps)
    return ProgramTrace(
        name=name,
        steps=steps,
        shared_prefix_tokens=shared_prefix,
        source=ctx.file,
        block_size=ctx.block_size if has_hashes else None,
        provider="claude",  # the set records Claude Code sessions at an Anthropic API proxy
    )


def _hash_tuple(req: Fields, hashes: list[object]) -> Sequence[int]:
    for index, value in enumerate(hashes):
        if isinstance(value, bool) or not isinstance(value, int):
            raise req.error(f"expected an integer block id, got {value!r}", f"hash_ids[{index}]")
    return block_hashes(hashes)  # type: ignore[arg-type]


def _parse_subagent(req: Fields, ctx: _Context, parent: str, index: int) -> _Sub | None:
    """Convert a subagent entry; ``None`` if it made no LLM call."""
    t = req.number("t")
    agent_id = req.opt_text("agent_id") or f"#{index}"
    shared = req.integer("tool_tokens", 0) + req.integer("system_tokens", 0)
    program = _parse_program(req, ctx, f"{parent}/{agent_id}", shared)
    if program is None:
        return None
    duration_ms = req.opt_number("duration_ms")
    end = t + (duration_ms / 1000.0 if duration_ms is not None else _span(req))
    return _Sub(t=t, end=end, program=program)


def _span(sub: Fields) -> float:
    """Seconds from a subagent's first LLM call to the end of its last one."""
    times: list[float] = []
    for index, raw in enumerate(sub.array("requests")):
        req = sub.child(raw, f"{sub.path('requests')}[{index}]")
        if req.opt_text("type") != "subagent":
            times += [req.number("t"), req.number("t") + req.number("api_time", 0.0)]
    return max(0.0, max(times) - min(times)) if times else 0.0


def _make_step(call: _Call, nxt: _Call | None) -> Step:
    """The step for ``call``, given the program's next call (``None`` for the last)."""
    spawns = tuple(SubagentSpawn(max(0.0, s.t - call.end), s.program) for s in call.subs)
    if spawns:
        kind = GapKind.SUBAGENT
        gap = 0.0 if nxt is None else max(0.0, nxt.t - max(s.end for s in call.subs))
    elif nxt is None:
        kind, gap = GapKind.END, 0.0
    else:
        kind = GapKind.TOOL if call.stop == "tool_use" else GapKind.HUMAN
        interval = max(0.0, nxt.t - call.t)
        if nxt.think_time is not None:
            gap = min(nxt.think_time, interval)
        elif call.api_time is not None:
            gap = max(0.0, interval - call.api_time)
        else:
            gap = interval
    return Step(
        prompt_tokens=call.prompt,
        output_tokens=call.output,
        gap_s=gap,
        gap_kind=kind,
        reuse_tokens=call.reuse,
        subagents=spawns,
        call_s=call.api_time,
        block_hashes=call.hashes,
    )
