"""The ``--kv-transfer-config`` that gives vLLM MORI's CPU tier (no vLLM import).

vLLM's ``OffloadingConnector`` keeps a host KV tier; ``kv_connector_extra_config`` names
the cache policy that picks which host chunk to evict (``eviction_policy`` +
``cache_policy_module_path``) and, out of tree, the offloading spec (``spec_name`` +
``spec_module_path``). :func:`kv_transfer_config` builds that value for MORI's
``cpu_tier.MoriCachePolicy``, with ``host_tier.MoriHostOffloadingSpec`` on the CPU build
(vLLM's own spec refuses the CPU platform) and vLLM's ``CPUOffloadingSpec`` on GPUs.
``mori vllm-args --cpu-gib N`` prints it (with ``--disk-gib N --disk-dir PATH``, MORI's disk
tier behind it: ``disk_tier``); the contract test inside vLLM's venv checks that
vLLM still loads what these names say.

The requests' programs reach the cache policy through ``kv_transfer_params``: the MORI
scheduler copies ``Request.session_id`` into ``kv_transfer_params[PROGRAM_KEY]`` before
the connector sees the request.
"""

from __future__ import annotations

from typing import Any

PROGRAM_KEY = "mori_program"  # in a request's kv_transfer_params
POLICY_NAME = "MoriCachePolicy"
POLICY_MODULE = "mori.vllm_plugin.cpu_tier"
HOST_SPEC_NAME = "MoriHostOffloadingSpec"
HOST_SPEC_MODULE = "mori.vllm_plugin.host_tier"
TIERING_SPEC_NAME = "MoriTieringOffloadingSpec"  # the CPU build's; on GPUs vLLM's own:
VLLM_TIERING_SPEC = "TieringOffloadingSpec"
DISK_TIER_TYPE = "MoriDiskTier"
DISK_TIER_MODULE = "mori.vllm_plugin.disk_tier"
GIB = 1 << 30


def kv_transfer_config(cpu_bytes: int, *, host_spec: bool = True,
                       block_size: int | None = None, mori_order: bool = True,
                       disk_bytes: int | None = None, disk_dir: str | None = None
                       ) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for an ``OffloadingConnector`` host tier of
    ``cpu_bytes`` evicted by MORI's ``MoriCachePolicy``.

    ``host_spec``: use ``MoriHostOffloadingSpec`` (CPU build); ``False`` keeps vLLM's
    ``CPUOffloadingSpec`` (GPUs). ``block_size``: tokens per host chunk (a multiple of the
    engine's block size; vLLM's default, one block). ``mori_order=False`` keeps vLLM's own
    ``lru`` policy (the baseline: the same tier, vLLM's order). ``offload_prompt_only`` is
    off: an agent's next turn reuses its previous turns' generated tokens too.

    ``disk_bytes`` and ``disk_dir`` (both or neither) put MORI's disk tier
    (``disk_tier.MoriDiskTier``, files under ``disk_dir``) behind the host tier, through
    vLLM's tiering spec (``MoriTieringOffloadingSpec`` on the CPU build, vLLM's
    ``TieringOffloadingSpec`` on GPUs). The disk tier evicts in MORI's order once the
    plug-in binds it; unbound (``mori_order=False``, no plug-in) it evicts least recently
    used first.
    """
    if cpu_bytes <= 0:
        raise ValueError(f"cpu_bytes must be > 0, not {cpu_bytes}")
    if (disk_bytes is None) != (disk_dir is None):
        raise ValueError("a disk tier needs both disk_bytes and disk_dir")
    if disk_bytes is not None and disk_bytes <= 0:
        raise ValueError(f"disk_bytes must be > 0, not {disk_bytes}")
    extra: dict[str, Any] = {"cpu_bytes_to_use": int(cpu_bytes)}
    if mori_order:
        extra["eviction_policy"] = POLICY_NAME
        extra["cache_policy_module_path"] = POLICY_MODULE
    else:
        extra["eviction_policy"] = "lru"
    extra["offload_prompt_only"] = False
    if disk_bytes is not None:
        extra["secondary_tiers"] = [{"type": DISK_TIER_TYPE, "module_path": DISK_TIER_MODULE,
                                     "path": str(disk_dir), "capacity_bytes": int(disk_bytes)}]
        if host_spec:
            extra["spec_name"] = TIERING_SPEC_NAME
            extra["spec_module_path"] = HOST_SPEC_MODULE
        else:
            extra["spec_name"] = VLLM_TIERING_SPEC
    elif host_spec:
        extra["spec_name"] = HOST_SPEC_NAME
        extra["spec_module_path"] = HOST_SPEC_MODULE
    if block_size is not None:
        extra["block_size"] = int(block_size)
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def tokens_per_chunk(extra: dict[str, Any] | None, engine_block_size: int) -> int:
    """Tokens one host chunk holds, as vLLM derives it from ``kv_connector_extra_config``
    (``block_size`` in tokens, or ``blocks_per_chunk``; one engine block without either;
    ``distributed/kv_transfer/kv_connector/v1/offloading/config.py:98-134`` in vLLM 0.32)."""
    extra = extra or {}
    if extra.get("block_size") is not None:
        return int(extra["block_size"])
    if extra.get("blocks_per_chunk") is not None:
        return int(extra["blocks_per_chunk"]) * engine_block_size
    return engine_block_size
