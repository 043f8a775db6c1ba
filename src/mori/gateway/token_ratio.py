"""Prompt sizes estimated at arrival, corrected by what the engines counted: ``TokenRatio``.

Without ``--exact-tokens`` the gateway sizes a request at arrival from its text (4
characters a token, ``mori.protocol.tokens``): no round trip before the policy sees it.
An engine's tokenizer can count several times that (a random-weight model's
vocabulary, a chat template), and the engine says its count in each answer's usage.
``TokenRatio`` keeps, per served model, engine tokens per estimated token over the
recent answers (sums that decay by ``DECAY`` at each answer), and scales each new
estimate by it: the policy places a request by about the size the engine will give it,
without asking. Before the first answer of a model the estimate stands as it is.

An approximation, stated: one ratio per model for every program and every part of a
prompt (a conversation whose new turns tokenize unlike its old ones is off by the
difference until its answer's usage books the exact count). ``--exact-tokens`` asks the
engine's ``/tokenize`` instead: exact, one more round trip per request.
"""

from __future__ import annotations

import math

DECAY = 0.9
"""Each answer keeps this share of the sums before it (about the last ten answers)."""

BOUNDS = (1 / 16, 16.0)
"""The ratio is kept within these (an engine's absurd count cannot make sizes absurd)."""


class TokenRatio:
    """Per served model: engine tokens per estimated token, learned from answers."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[float, float]] = {}  # model -> (exact, estimated)

    def observe(self, model: str, estimated: int, exact: int) -> None:
        """An answer of ``model`` counted ``exact`` prompt tokens for a request the
        gateway had estimated at ``estimated``. Counts below 1 are ignored."""
        if estimated < 1 or exact < 1:
            return
        e, s = self._sums.get(model, (0.0, 0.0))
        self._sums[model] = (DECAY * e + exact, DECAY * s + estimated)

    def ratio(self, model: str) -> float | None:
        """Engine tokens per estimated token for ``model`` (None: no answer yet)."""
        sums = self._sums.get(model)
        if sums is None or sums[1] <= 0:
            return None
        lo, hi = BOUNDS
        return min(hi, max(lo, sums[0] / sums[1]))

    def scaled(self, model: str, estimated: int) -> int:
        """``estimated`` in ``model``'s engine tokens, as far as answers have told."""
        r = self.ratio(model)
        if r is None:
            return estimated
        return max(1, math.ceil(estimated * r - 1e-9))
