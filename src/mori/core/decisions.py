"""Decisions are data: a policy returns them, the world that drives it executes them.

Order matters within one ``decide()`` result: a ``Promote`` precedes the ``Forward`` of
the same program, and the ``Demote`` decisions that made room precede the ``Promote``.
The engine's type label (docs/system.md, "Typed offloading in the engine") follows from these decisions: ``Promote`` ->
busy, ``Demote(to=CPU)`` -> idle, ``Demote(to=DISK)`` -> cold, ``Demote(to=NONE)`` and
``Release`` -> inactive.
"""

from __future__ import annotations

from dataclasses import dataclass

from mori.core.types import Tier


@dataclass(frozen=True, slots=True)
class Forward:
    """Send the program's held request to ``replica`` now."""

    program_id: str
    replica: int


@dataclass(frozen=True, slots=True)
class Promote:
    """The program joins the GPU queue of ``replica``; ``source`` is where its KV was
    (CPU: reload over PCIe; DISK: read back from the replica's disk; NONE: recompute;
    GPU: it was on another replica's GPU and is
    re-routed here, leaving that copy behind, so it recomputes)."""

    program_id: str
    replica: int
    source: Tier


@dataclass(frozen=True, slots=True)
class Demote:
    """The program leaves the GPU, CPU or disk queue of ``replica`` for ``to`` (CPU, DISK
    or NONE).

    ``source`` is the tier it leaves.
    """

    program_id: str
    replica: int
    source: Tier
    to: Tier


@dataclass(frozen=True, slots=True)
class Release:
    """The program ended; whatever KV it holds on ``replica`` is inactive."""

    program_id: str
    replica: int | None


Decision = Forward | Promote | Demote | Release
