"""The policy registry: one place lists every policy; the CLI takes its choices here."""

from __future__ import annotations

from mori.core.ledger import ClusterSpec
from mori.core.policies.mori import MoriPolicy
from mori.core.policies.mori_variants import (
    MoriBinaryPolicy,
    MoriNoExclusionPolicy,
    MoriPackPolicy,
    MoriPaperPolicy,
    MoriSkiPolicy,
    MoriStrictPolicy,
    MoriYieldPolicy,
)
from mori.core.policies.smg import LRUOffloadPolicy, SMGPolicy
from mori.core.policies.thunderagent import ThunderAgentOffloadPolicy, ThunderAgentPolicy
from mori.core.policy import Policy, PolicyConfig
from mori.core.registry import Registry


def _build() -> Registry[type[Policy]]:
    reg: Registry[type[Policy]] = Registry("policy")
    for cls in (MoriPolicy, SMGPolicy, LRUOffloadPolicy, ThunderAgentPolicy, ThunderAgentOffloadPolicy,
                MoriBinaryPolicy, MoriNoExclusionPolicy, MoriStrictPolicy, MoriPackPolicy,
                MoriSkiPolicy, MoriYieldPolicy, MoriPaperPolicy):
        reg.register(cls.name, cls)
    reg.freeze()
    return reg


POLICIES = _build()
"""Every registered policy, by name (frozen)."""

PAPER_POLICIES = ("smg", "thunderagent", "thunderagent+offload", "mori")
"""The four policies of the paper's main comparison."""


def build_policy(name: str, cluster: ClusterSpec, kv_bytes_per_token: int,
                 config: PolicyConfig) -> Policy:
    """The registered policy ``name`` over ``cluster``: the one way both worlds build it.

    ``cluster`` gives the full capacities of each replica's tiers; a policy without a CPU
    queue drops that tier itself. Raises ``UnknownNameError`` (listing the choices) for
    an unknown name.
    """
    return POLICIES.get(name)(cluster, kv_bytes_per_token, config)

__all__ = ["POLICIES", "PAPER_POLICIES", "build_policy", "MoriPolicy", "SMGPolicy", "LRUOffloadPolicy", "ThunderAgentPolicy",
           "ThunderAgentOffloadPolicy", "MoriBinaryPolicy", "MoriNoExclusionPolicy", "MoriStrictPolicy",
           "MoriPackPolicy", "MoriSkiPolicy", "MoriYieldPolicy", "MoriPaperPolicy"]
