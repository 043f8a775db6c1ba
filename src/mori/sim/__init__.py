"""The discrete-event simulator: engine replicas, closed-loop replay, metrics."""

MODEL_VERSION = 1
"""Bumped whenever a change to the simulator or a policy changes results for the same
settings, so stored sweep results from an older model are not reused."""
