"""Enumerations shared by the policy core and the worlds that drive it."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """What a program is doing at an instant (MORI.md section 2)."""

    REASONING = "reasoning"  # its request is executing on an engine
    ACTING = "acting"  # its response ended; it is in a tool call, its KV sits idle
    GATED = "gated"  # a request arrived but the scheduler holds it


class Tier(StrEnum):
    """Where the scheduler keeps a program's KV."""

    GPU = "gpu"
    CPU = "cpu"
    NONE = "none"  # the global Waiting queue: no cache, a return means recompute


class KVLabel(StrEnum):
    """Type label the engine uses above plain LRU (MORI.md section 5)."""

    BUSY = "busy"  # GPU queue
    IDLE = "idle"  # CPU queue
    INACTIVE = "inactive"  # not scheduled anywhere (Waiting, or ended)
