"""Tests that run inside SGLang's own venv (SGLang 0.5.23 on CPU tensors, no server):
the MORI plug-in's radix-cache backend on SGLang's real cache classes.

SGLang's server does not start on these CPUs (``shared/ENGINES.md``: its CPU backend
needs sgl-kernel ops PyPI does not ship), so the tests build SGLang's
``UnifiedRadixCache`` (and HiCache's host tier) through its own registry with CPU pools,
and drive them as the scheduler does: requests matched and checkpointed into the tree
(``mem_cache.common.match_kv_cache``, ``cache.checkpoint``), evictions. Run them with
that venv's python from the repository root::

    PYTHONPATH=src ~/.cache/mori/sglang-venv/bin/python -m pytest -q tests/sglang_inside

(``tests/e2e/test_sglang_plugin_unit.py`` does so from the main suite; the venv comes
from ``scripts/sglang_cpu_env.sh``.) The main suite does not collect this folder.

HiCache on a CPU needs three test-only shims (:func:`cpu_hicache_shims`): host memory
allocated plainly (no ``cudaHostRegister``), a pure-torch ``transfer_kv_direct`` and a
no-op ``torch.cpu.Stream.synchronize``. They replace GPU plumbing, not the cache's logic.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("SGLANG_PLUGINS", "none")  # no installed plug-in is loaded by surprise
warnings.filterwarnings("ignore")

from mori.sglang_plugin.cpu_rig import (  # noqa: E402,F401 -- the tests import them from here
    PAGE,
    Tree,
    build_tree,
    cpu_hicache_shims,
)


def seq(start: int, n: int = 8) -> list[int]:
    """``n`` tokens (two pages) from ``start``."""
    return list(range(start, start + n))


@pytest.fixture(autouse=True)
def _labels_on_a_free_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every cache the tests build binds its own label endpoint."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MORI_LABEL_ENDPOINT", f"tcp://127.0.0.1:{port}")
    yield
