"""The policy registry: one place lists every policy; the CLI takes its choices here."""

from __future__ import annotations

from mori.core.policies.ablations import (
    MoriBinaryPolicy,
    MoriNoExclusionPolicy,
    MoriStrictPolicy,
)
from mori.core.policies.mori import MoriPolicy
from mori.core.policies.smg import SMGPolicy
from mori.core.policies.thunderagent import ThunderAgentOffloadPolicy, ThunderAgentPolicy
from mori.core.policy import Policy
from mori.core.registry import Registry


def _build() -> Registry[type[Policy]]:
    reg: Registry[type[Policy]] = Registry("policy")
    for cls in (MoriPolicy, SMGPolicy, ThunderAgentPolicy, ThunderAgentOffloadPolicy,
                MoriBinaryPolicy, MoriNoExclusionPolicy, MoriStrictPolicy):
        reg.register(cls.name, cls)
    reg.freeze()
    return reg


POLICIES = _build()
"""Every registered policy, by name (frozen)."""

PAPER_POLICIES = ("smg", "thunderagent", "thunderagent+offload", "mori")
"""The four policies of the paper's main comparison."""

__all__ = ["POLICIES", "PAPER_POLICIES", "MoriPolicy", "SMGPolicy", "ThunderAgentPolicy",
           "ThunderAgentOffloadPolicy", "MoriBinaryPolicy", "MoriNoExclusionPolicy", "MoriStrictPolicy"]
