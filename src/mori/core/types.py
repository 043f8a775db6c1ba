"""Enumerations shared by the policy core and the worlds that drive it."""

from __future__ import annotations

from enum import StrEnum


class Status(StrEnum):
    """What a program is doing at an instant (docs/system.md, "Programs, steps and status")."""

    REASONING = "reasoning"  # its request is executing on an engine
    ACTING = "acting"  # its response ended; it is in a tool call, its KV sits idle
    HELD = "held"  # a request arrived and the scheduler holds it (not yet forwarded)


class Tier(StrEnum):
    """Where the scheduler keeps a program's KV."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"  # the replica's disk tier (NVMe): a return reads it back from disk
    NONE = "none"  # the global Uncached queue: no cache, a return means recompute


class KVLabel(StrEnum):
    """Type label the engine uses above plain LRU (docs/system.md, "Typed offloading in the engine")."""

    BUSY = "busy"  # GPU queue
    IDLE = "idle"  # CPU queue
    COLD = "cold"  # disk queue: keep it on the replica's disk, leave the faster tiers
    INACTIVE = "inactive"  # not scheduled anywhere (Uncached, or ended)


class Capability(StrEnum):
    """KV controls an engine may offer the world that drives it (docs/engines.md).

    The decision executor (``mori.core.execution``) turns decisions into engine actions
    using only the capabilities an engine declares.
    """

    PRIORITY = "priority"  # per-request priority hints
    LABELS = "labels"  # typed busy / idle / inactive eviction labels per program
    OFFLOAD = "offload"  # move one program's GPU KV to the host tier now
    PREFETCH = "prefetch"  # pull one program's host KV back to the GPU before its request
    DROP = "drop"  # drop one program's KV (all tiers) now
    RESIDENCY = "residency"  # report which programs' KV is where
    SYNTHETIC_PROMPTS = "synthetic_prompts"  # honours the ``mori`` prompt-size field
    TOKENIZE = "tokenize"  # counts a request's prompt tokens exactly
    KV_READY = "kv_ready"  # says in a stream when the request's KV is in place
