"""MORI: Memory Offloader with Relative Idleness.

Layers (imports flow one way): ``mori.core`` (pure policy core and cost model) <-
``mori.traces`` (trace model and loaders) <- ``mori.sim`` (discrete-event simulator) <-
``mori.cli``.
"""

__version__ = "0.1.0"
