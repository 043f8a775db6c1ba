"""Model aliases: the names agents ask for, mapped onto the models the engines serve.

Agents ask for their own model names (Claude Code for a Sonnet and a small fast model,
Codex for a GPT). ``--model-alias PATTERN=SERVED`` (repeatable) maps every name matching
``PATTERN`` (shell-style: ``*``, ``?``, ``[...]``; matched in full, case-sensitive) onto
``SERVED``; the first matching rule wins. A name the engines serve is never mapped. A
name neither served nor mapped onto a served model gets the API's own not-found error,
listing the models served.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelAliases:
    """The rules, in order: (pattern text, its compiled form, the served name)."""

    rules: tuple[tuple[str, re.Pattern[str], str], ...] = ()

    @classmethod
    def parse(cls, specs: tuple[str, ...] | list[str]) -> ModelAliases:
        """Rules from ``PATTERN=SERVED`` strings; ``ValueError`` saying which is malformed."""
        rules = []
        for spec in specs:
            pattern, sep, served = spec.partition("=")
            pattern, served = pattern.strip(), served.strip()
            if not sep or not pattern or not served:
                raise ValueError(f"--model-alias {spec!r}: expected PATTERN=SERVED, e.g. "
                                 "'claude-*=qwen3-30b'")
            rules.append((pattern, re.compile(fnmatch.translate(pattern)), served))
        return cls(tuple(rules))

    def resolve(self, asked: str, served: frozenset[str]) -> str | None:
        """The served model for ``asked``: itself if served, else the first matching rule's
        target if that is served; None otherwise."""
        if asked in served:
            return asked
        for _, rx, target in self.rules:
            if rx.fullmatch(asked):
                return target if target in served else None
        return None

    def describe(self) -> list[str]:
        return [f"{p}={t}" for p, _, t in self.rules]
