"""The flags ``mori sglang-args`` prints, read by SGLang's own launcher code: the backend
registered (as the entry point does), then ``prepare_server_args`` (the parser
``sglang.launch_server`` builds) and ``resolve_once`` (the launcher's resolution)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest
from sglang.srt.disaggregation.kv_events import KVEventsConfig
from sglang.srt.mem_cache.registry import registered_radix_cache_backends
from sglang.srt.server_args import prepare_server_args

from mori.cli.sglang_args_cmd import BACKEND, TESTED_SGLANG, sglang_flags
from mori.sglang_plugin import backend


def server_args(flags: list[str]) -> Any:
    """``ServerArgs`` as ``python -m sglang.launch_server --model-path dummy --device cpu
    FLAGS`` builds and resolves them (the model itself is never loaded)."""
    backend.register()
    args = prepare_server_args(["--model-path", "dummy", "--device", "cpu", *flags])
    args.resolve_once()
    return args


def test_the_release_and_the_backend_name_are_the_plugins() -> None:
    assert metadata.version("sglang") == TESTED_SGLANG
    assert BACKEND == backend.BACKEND
    backend.register()
    assert BACKEND in registered_radix_cache_backends()


def test_the_default_flags() -> None:
    args = server_args(sglang_flags())
    assert args.radix_cache_backend == "mori"
    assert args.enable_priority_scheduling is True
    assert args.enable_metrics is True
    assert args.enable_hierarchical_cache is False
    events = KVEventsConfig.from_cli(args.kv_events_config)
    assert (events.publisher, events.endpoint, events.topic) == (
        "zmq", "tcp://*:5557", "kv-events")


@pytest.mark.parametrize("ratio, policy", [(None, None), (4.0, "write_through"),
                                           (1.5, "write_through_selective")])
def test_the_hicache_flags(ratio: float | None, policy: str | None) -> None:
    args = server_args(sglang_flags(hicache=True, hicache_ratio=ratio,
                                    hicache_write_policy=policy,
                                    kv_events_endpoint="tcp://*:6557"))
    assert args.radix_cache_backend == "mori"
    assert args.enable_priority_scheduling is True
    assert args.enable_hierarchical_cache is True
    assert args.hicache_ratio == (ratio or 2.0)
    assert args.hicache_write_policy == (policy or "write_back")
    assert KVEventsConfig.from_cli(args.kv_events_config).endpoint == "tcp://*:6557"


def test_the_no_plugin_flags() -> None:
    args = server_args(sglang_flags(plugin=False, hicache=True))
    assert args.radix_cache_backend is None
    assert args.radix_eviction_policy == "priority"
    assert args.enable_priority_scheduling is True
    assert args.enable_hierarchical_cache is True
    assert args.hicache_write_policy == "write_back"
