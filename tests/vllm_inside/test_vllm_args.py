"""``mori vllm-args``' flags, parsed by the installed vLLM's own ``vllm serve`` parser
(``make_arg_parser``, which moved between releases) into its ``AsyncEngineArgs``: every
flag exists in this release and means what the plug-in expects. On 0.32 and 0.33 a real
engine also starts with them (``tests/e2e``); on 0.34, which cannot run a model on these
CPUs, this is where its flags are checked."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from mori.cli.vllm_args_cmd import SCHEDULER_CPU, SCHEDULER_GPU, vllm_flags
from mori.plugin_channel.server import ENDPOINT_KEY, SECRET_FILE_KEY

from .conftest import tiny_model_dir

PARSER_MODULES = ("vllm.entrypoints.common.cli_args",  # 0.33, 0.34
                  "vllm.entrypoints.launchers.cli_args")  # 0.32


def serve_parser() -> Any:
    for name in PARSER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        return module.make_arg_parser(FlexibleArgumentParser())
    pytest.fail(f"vLLM's `vllm serve` parser (make_arg_parser) is in none of "
                f"{PARSER_MODULES}: find where it moved", pytrace=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory)  # a local model: nothing is looked up


def parse(model: Path, **kw: Any) -> tuple[Any, Any]:
    args = serve_parser().parse_args(["--model", str(model), *vllm_flags(**kw)])
    return args, AsyncEngineArgs.from_cli_args(args)


def test_the_plugins_flags(model: Path) -> None:
    args, e = parse(model, label_endpoint="tcp://127.0.0.1:6558", label_secret_file="/k",
                    kv_events_endpoint="tcp://*:6557")
    assert e.scheduler_cls == SCHEDULER_GPU
    assert e.additional_config == {ENDPOINT_KEY: "tcp://127.0.0.1:6558",
                                   SECRET_FILE_KEY: "/k"}
    assert e.scheduling_policy == "priority" and e.enable_prefix_caching is True
    assert args.enable_prompt_tokens_details is True
    ev = e.kv_events_config
    assert (ev.enable_kv_cache_events, ev.publisher, ev.endpoint, ev.topic) == (
        True, "zmq", "tcp://*:6557", "kv-events")
    assert e.kv_transfer_config is None and e.kv_offloading_size is None
    assert parse(model, build="cpu")[1].scheduler_cls == SCHEDULER_CPU


@pytest.mark.parametrize("build", ["gpu", "cpu"])
def test_a_host_tier_and_a_disk_tier(model: Path, build: str) -> None:
    _, e = parse(model, build=build, cpu_gib=0.5)
    kv = e.kv_transfer_config
    assert (kv.kv_connector, kv.kv_role) == ("OffloadingConnector", "kv_both")
    extra = kv.kv_connector_extra_config
    assert extra["cpu_bytes_to_use"] == 1 << 29
    assert (extra["eviction_policy"], extra["cache_policy_module_path"]) == (
        "MoriCachePolicy", "mori.vllm_plugin.cpu_tier")
    assert ("spec_module_path" in extra) is (build == "cpu")
    _, e = parse(model, build=build, cpu_gib=1, disk_gib=2, disk_dir="/tmp")
    extra = e.kv_transfer_config.kv_connector_extra_config
    assert json.dumps(extra).count("mori.vllm_plugin.disk_tier") == 1, extra


def test_without_the_plugin(model: Path) -> None:
    _, e = parse(model, plugin=False, cpu_gib=2)
    assert e.additional_config == {} and e.kv_transfer_config is None
    assert (e.kv_offloading_size, e.kv_offloading_backend) == (2.0, "native")
    default = AsyncEngineArgs.scheduler_cls  # vLLM's own scheduler
    assert e.scheduler_cls == default
