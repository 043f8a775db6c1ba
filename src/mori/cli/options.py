"""The options of ``mori simulate``, declared once for the argument parser and TOML files.

Each :class:`Option` knows its flag, its type, whether it takes a comma-separated list,
its default and its help text; it converts both a command-line string and a TOML value.
The defaults of the simulation knobs come from :class:`mori.sim.config.SimConfig`, so the
CLI cannot drift from the simulator.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mori.core.costmodel import PRESETS
from mori.core.policies import PAPER_POLICIES, POLICIES
from mori.sim.config import SimConfig
from mori.sim.workload import HUMAN_GAP_RULES

_SIM = SimConfig()
_KIND_WORDS: dict[type, tuple[str, str]] = {
    int: ("an integer", "integers"), float: ("a number", "numbers"),
    str: ("a string", "strings"), bool: ("true or false", "booleans"),
    Path: ("a path (string)", "paths"),
}


class OptionError(ValueError):
    """A value that does not fit its option; the message says what was expected."""


def _toml_type(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
             list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)


@dataclass(frozen=True, slots=True)
class Option:
    """One option: ``key`` is the attribute name; the flag is ``--key-with-dashes``."""

    key: str
    kind: type
    default: Any
    help: str
    multi: bool = False
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        """The long command-line flag."""
        return "--" + self.key.replace("_", "-")

    def what(self) -> str:
        """What a valid value looks like, in words."""
        if self.choices:
            return f"one of {', '.join(self.choices)}"
        one, many = _KIND_WORDS[self.kind]
        return f"a comma-separated list of {many}" if self.multi else one

    def parse_text(self, text: str) -> Any:
        """The value of a command-line string (a tuple for list options)."""
        if not self.multi:
            return self._scalar(text, text)
        items = [t.strip() for t in text.split(",")]
        if not all(items):
            raise OptionError(f"expected {self.what()}, got {text!r}")
        return tuple(self._scalar(t, t) for t in items)

    def from_toml(self, value: object) -> Any:
        """The value of a TOML value; list options take an array, a scalar or a comma string."""
        if not self.multi:
            return self._scalar(value, None)
        if isinstance(value, str):
            return self.parse_text(value)
        items = value if isinstance(value, list) else [value]
        if not items:
            raise OptionError(f"expected {self.what()}, got an empty array")
        return tuple(self._scalar(v, None) for v in items)

    def _scalar(self, value: object, text: str | None) -> Any:
        """Convert one item; ``text`` is the command-line spelling (None for TOML)."""
        kind, got = self.kind, repr(text) if text is not None else _toml_type(value)
        bad = OptionError(f"expected {self.what()}, got {got}")
        if text is not None and kind in (int, float, bool):
            try:
                value = int(text) if kind is int else float(text) if kind is float else None
            except ValueError:
                raise bad from None
        if kind is bool:
            if not isinstance(value, bool):
                raise bad
            return value
        if isinstance(value, bool):
            raise bad
        if kind is int:
            if not isinstance(value, int):
                raise bad
            return value
        if kind is float:
            if not isinstance(value, int | float):
                raise bad
            if not math.isfinite(value):
                raise OptionError(f"expected a finite number, got {value}")
            return float(value)
        if not isinstance(value, str) or not value:
            raise bad
        if self.choices is not None and value not in self.choices:
            raise OptionError(f"expected one of {', '.join(self.choices)}, got {value!r}")
        return Path(value) if kind is Path else value


def _default_text(opt: Option) -> str:
    if opt.default is None or opt.default is False:
        return ""
    items = opt.default if isinstance(opt.default, tuple) else (opt.default,)
    shown = ",".join(format(v, "g") if isinstance(v, float) else str(v) for v in items)
    return f" (default: {shown})"


OPTIONS: tuple[Option, ...] = (
    Option("policy", str, tuple(PAPER_POLICIES), metavar="A,B,...", multi=True,
           help="policies to compare; one run per policy at every grid point; "
                f"valid: {', '.join(POLICIES.names())} (default: the paper's four, "
                f"{','.join(PAPER_POLICIES)})"),
    Option("programs", int, (20, 50, 80), metavar="N,N,...", multi=True,
           help="numbers of concurrent agentic programs (closed-loop slots)"),
    Option("hardware", str, (_SIM.hardware,), metavar="PRESET,...", multi=True,
           help="hardware presets, one replica each (see `mori presets`); "
                f"valid: {', '.join(PRESETS.names())}"),
    Option("cpu_ratio", float, (_SIM.cpu_ratio,), metavar="R,...", multi=True,
           help="CPU KV tier size as a multiple of the GPU KV capacity (see below)"),
    Option("replicas", int, _SIM.replicas, metavar="N",
           help="engine replicas, each with the preset's GPUs"),
    Option("duration", float, _SIM.duration_s, metavar="SECONDS",
           help="simulated seconds per run"),
    Option("traces", Path, None, metavar="PATH",
           help="trace set: a kv-cache-tester directory or .json file, or a MORI .jsonl[.gz] "
                "file (default: the shipped kv-cache-tester-31 set of Claude Code sessions)"),
    Option("seed", int, _SIM.seed, metavar="N",
           help="random seed (program order and start times)"),
    Option("json", Path, None, metavar="FILE",
           help="also write every run's metrics to FILE as a JSON list, in grid order"),
    Option("plot", Path, None, metavar="FILE.png",
           help="also plot throughput, steps/s and TTFT against programs to FILE.png"),
    Option("human_gap", str, _SIM.human_gap, choices=HUMAN_GAP_RULES, metavar="RULE",
           help=f"what to do with human think time after a final answer: "
                f"{' or '.join(HUMAN_GAP_RULES)} (see below)"),
    Option("human_gap_cap", float, _SIM.human_gap_cap_s, metavar="S",
           help="cap on a human gap, seconds"),
    Option("max_context", int, None, metavar="TOKENS",
           help="cut programs at this context length (default: the model's context window)"),
    Option("share_prefix", bool, _SIM.share_prefix,
           help="let programs share their common system-prompt prefix in the KV cache "
                "(default: off)"),
    Option("tick", float, _SIM.tick_s, metavar="S",
           help="period of the policy's control loop, seconds"),
    Option("window", int, _SIM.idleness_window, metavar="K",
           help="idleness window: the number of recent cycles a program's idleness ranks by"),
    Option("jobs", int, 1, metavar="N",
           help="runs in parallel processes (0: one per CPU); results keep the grid order "
                "either way"),
    Option("quiet", bool, False, help="no progress bar or notes on stderr (default: off)"),
)
"""Every option of ``mori simulate`` except ``--config``, in help order."""

BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}


def help_text(opt: Option) -> str:
    """The help line of ``opt``, with its default appended when it has one to show."""
    if opt.key == "policy":
        return opt.help
    return opt.help + _default_text(opt)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option],
                help_of: Callable[[Option], str] | None = None) -> None:
    """Declare ``options`` on ``parser``: booleans as ``--x/--no-x``, the rest parsed by
    ``Option.parse_text``; every default is None, so a config file can fill the gaps."""
    for opt in options:
        text = (help_of or help_text)(opt)
        if opt.kind is bool:
            parser.add_argument(opt.flag, action=argparse.BooleanOptionalAction, default=None,
                                help=text)
        else:
            parser.add_argument(opt.flag, type=_arg_type(opt), default=None,
                                metavar=opt.metavar, help=text)


def _arg_type(opt: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return opt.parse_text(text)
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = opt.key  # argparse names the type in some messages
    return parse
