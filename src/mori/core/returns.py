"""Predicted returns: how long a program's tool call will last, from what a gateway sees.

A program in a tool call sends its next request when the call ends. Bringing its KV
back before then (a prefetch) pays only if the gateway knows roughly when that is. The
estimate, in seconds from the end of the program's response, comes from three sources,
each a median (tool times are heavy-tailed: one slow build outweighs ten file reads in a
mean):

- **own**: the program's own recent tool times (its idleness window: the acting part of
  its last completed cycles, ``IdlenessTracker.cycles``);
- **tools**: the tools its response called, read from the wire (Claude Code's
  ``tool_use`` blocks, an OpenAI response's ``tool_calls``): the times of recent calls
  of each, across programs; for a response that calls several, the slowest of their
  medians (they run one after another or at once: either way the slowest bounds it);
- **kind**: recent tool times of programs of the same agent kind (Claude Code, Codex,
  or one key for all).

Which source answers is the predictor's ``rule`` (``RULES``), measured on the shipped and
recorded traces by ``bench/predicted_returns.py`` (docs/results.md, "Predicted
returns"): by default the tools, else the kind. A program's own history was no better
than its kind's on the kv-cache-tester sessions (median absolute error 4-5 s against
4 s), and worse on the recorded Claude Code sessions (0.8 s against 0.2 s; the tools'
0.2 s, within a factor of two of the call's length for 58% of the calls against the
kind's 35%). Not yet used by a policy: it is the first part of prefetching a program's
KV ahead of its return. Pure: no clock, no I/O; the caller passes what it saw.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RULES", "ReturnConfig", "ReturnPredictor"]

RULES = ("own", "tools", "own-then-tools", "tools-then-own", "kind")
"""How an estimate is chosen, each falling back to the next source with enough samples:

- ``own``: own, else kind, else the prior;
- ``tools``: tools, else kind, else the prior;
- ``own-then-tools``: own, else tools, else kind, else the prior;
- ``tools-then-own``: tools, else own, else kind, else the prior;
- ``kind``: kind, else the prior (the baseline: what a predictor that knows nothing of
  the program or its tools gets)."""


@dataclass(frozen=True, slots=True)
class ReturnConfig:
    """``rule``: one of ``RULES``. ``min_own``: the program's own tool times needed
    before they are used; ``min_tool``: a tool's recent calls needed; ``min_kind``: the
    kind's; ``keep``: recent calls kept per tool and per kind; ``max_names``: the most
    distinct tools (and kinds) tracked, the first ones seen (names come from clients: a
    gateway must not grow without bound); ``prior_s``: the answer with nothing known."""

    rule: str = "tools"
    min_own: int = 2
    min_tool: int = 3
    min_kind: int = 5
    keep: int = 200
    max_names: int = 1024
    prior_s: float = 10.0

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"unknown return rule {self.rule!r}: one of {', '.join(RULES)}")
        if min(self.min_own, self.min_tool, self.min_kind, self.keep, self.max_names) < 1:
            raise ValueError(f"the sample counts must be >= 1: {self!r}")
        if not self.prior_s >= 0.0:
            raise ValueError(f"prior_s must be >= 0 seconds, got {self.prior_s}")


class ReturnPredictor:
    """Expected tool-call seconds (the module docstring). ``observe`` feeds it each
    tool call that ended (how long it lasted, the tools it ran, the agent kind);
    ``expect_s`` answers for a call that starts."""

    def __init__(self, config: ReturnConfig | None = None) -> None:
        self.config = config or ReturnConfig()
        self._tools: dict[str, deque[float]] = {}
        self._kinds: dict[str, deque[float]] = {}

    def observe(self, seconds: float, tools: Sequence[str] = (), kind: str = "") -> None:
        """A tool call of ``seconds`` ended; it ran ``tools`` in a program of ``kind``."""
        if not seconds >= 0.0:
            raise ValueError(f"a tool call lasts >= 0 seconds, got {seconds}")
        for name in set(tools):
            self._add(self._tools, name, seconds)
        self._add(self._kinds, kind, seconds)

    def _add(self, table: dict[str, deque[float]], name: str, seconds: float) -> None:
        h = table.get(name)
        if h is None:
            if len(table) >= self.config.max_names:
                return
            h = table[name] = deque(maxlen=self.config.keep)
        h.append(seconds)

    def expect_s(self, own: Sequence[float] = (), tools: Sequence[str] = (),
                 kind: str = "") -> float:
        """Seconds the tool call starting now should last: ``own`` the program's recent
        tool times (oldest first), ``tools`` what its response called, ``kind`` its
        agent kind."""
        c = self.config
        for source in _ORDER[c.rule]:
            if source == "own":
                if len(own) >= c.min_own:
                    return float(statistics.median(own))
            elif source == "tools":
                known = [statistics.median(h) for name in set(tools)
                         if len(h := self._tools.get(name, ())) >= c.min_tool]
                if known:
                    return float(max(known))
            else:
                h = self._kinds.get(kind, ())
                if len(h) >= c.min_kind:
                    return float(statistics.median(h))
        return c.prior_s


_ORDER: dict[str, tuple[str, ...]] = {
    "own": ("own", "kind"),
    "tools": ("tools", "kind"),
    "own-then-tools": ("own", "tools", "kind"),
    "tools-then-own": ("tools", "own", "kind"),
    "kind": ("kind",),
}
