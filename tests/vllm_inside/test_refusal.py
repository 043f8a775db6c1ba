"""The plug-in refuses, when vLLM builds its classes and in one line, a vLLM whose
internals it does not know (``mori.vllm_plugin.compat``): an unknown release, or a hook
vLLM would call that the plug-in cannot take. The engine then stops at start-up instead
of at its first request."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import vllm
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from mori.vllm_plugin import compat, connector_config
from mori.vllm_plugin.cpu_tier import MoriCachePolicy, live_policies
from mori.vllm_plugin.scheduler import MoriScheduler

from .conftest import engine_configs, tiny_model_dir
from .test_contract import _offloading_config
from .test_scheduler import build

UNKNOWN = "0.99.1"


@pytest.fixture
def unknown_release(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(vllm, "__version__", UNKNOWN)
    monkeypatch.delenv(compat.UNVERIFIED_ENV, raising=False)
    yield


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[VllmConfig, KVCacheConfig]:
    return engine_configs(tiny_model_dir(tmp_path_factory), ["layer"])


def one_line(e: pytest.ExceptionInfo[compat.UnsupportedVllm], *, version: str = UNKNOWN
             ) -> str:
    line = str(e.value)
    assert "\n" not in line, line
    assert f"vLLM {version}" in line and f"supported: {compat.supported_text()}" in line
    assert "mori vllm-args --no-plugin" in line
    return line


def test_the_host_tiers_policy_refuses_an_unknown_release(unknown_release: None) -> None:
    before = len(live_policies())
    with pytest.raises(compat.UnsupportedVllm) as e:
        CPUOffloadingManager(num_chunks=4, cache_policy="MoriCachePolicy",
                             cache_policy_module_path="mori.vllm_plugin.cpu_tier")
    assert compat.UNVERIFIED_ENV in one_line(e)
    assert len(live_policies()) == before  # refused before it was built


def test_the_scheduler_refuses_an_unknown_release(
        unknown_release: None, configs: tuple[VllmConfig, KVCacheConfig],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_LABEL_ENDPOINT", "tcp://127.0.0.1:1")  # never bound
    with pytest.raises(compat.UnsupportedVllm) as e:
        build(MoriScheduler, configs)
    one_line(e)


def test_the_host_spec_refuses_an_unknown_release(unknown_release: None) -> None:
    extra = connector_config.kv_transfer_config(1 << 20)["kv_connector_extra_config"]
    with pytest.raises(compat.UnsupportedVllm) as e:
        OffloadingSpecFactory.create_spec(_offloading_config(extra))
    one_line(e)


def test_the_override_lets_an_unknown_release_load(unknown_release: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compat.UNVERIFIED_ENV, "1")
    mgr = CPUOffloadingManager(num_chunks=4, cache_policy="MoriCachePolicy",
                               cache_policy_module_path="mori.vllm_plugin.cpu_tier")
    assert isinstance(mgr._policy, MoriCachePolicy)


def test_a_new_hook_is_refused_even_in_a_supported_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM that would call a hook MoriCachePolicy does not define (its base's default
    would run in its place), or pass an argument it does not take, is refused whatever
    its version and the override."""
    monkeypatch.setenv(compat.UNVERIFIED_ENV, "1")

    def on_chunk_promoted(self: CachePolicy, key: object, tier: str) -> None:
        return None

    monkeypatch.setattr(CachePolicy, "on_chunk_promoted", on_chunk_promoted, raising=False)
    with pytest.raises(compat.UnsupportedVllm) as e:
        MoriCachePolicy(4)
    line = one_line(e, version=vllm.__version__)
    assert "CachePolicy.on_chunk_promoted is new to the plug-in" in line
    monkeypatch.undo()

    def evict(self: CachePolicy, n: int, protected: set[object], reason: str) -> None:
        return None

    monkeypatch.setattr(CachePolicy, "evict", evict)
    with pytest.raises(compat.UnsupportedVllm, match=r"CachePolicy\.evict now takes "
                                                     r"\(n, protected, reason\)"):
        MoriCachePolicy(4)


def test_the_scheduler_refuses_a_free_queue_with_new_members(
        configs: tuple[VllmConfig, KVCacheConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_LABEL_ENDPOINT", "tcp://127.0.0.1:1")
    monkeypatch.setattr(FreeKVCacheBlockQueue, "pop_lru_batch", lambda self, n: [],
                        raising=False)
    with pytest.raises(compat.UnsupportedVllm,
                       match="FreeKVCacheBlockQueue.pop_lru_batch is new to the plug-in"):
        build(MoriScheduler, configs)


def test_the_supported_release_installed_here_loads() -> None:
    assert compat.refusal(vllm.__version__, env={}) is None
    assert isinstance(MoriCachePolicy(4), MoriCachePolicy)
