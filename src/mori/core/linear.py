"""Small dense linear systems, solved exactly: ``solve``. Pure Python, for the few-term
least-squares fits of the engine's prices (``mori.core.engine_costs``) and of the
calibration of the CPU engine (``bench/calibrate_cpu_engine.py``)."""

from __future__ import annotations

__all__ = ["solve"]


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, y] for row, y in zip(a, b, strict=True)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                if f:
                    m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[r][n] / m[r][r] for r in range(n)]
