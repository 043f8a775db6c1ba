"""The layering of docs/architecture.md, and the static checks, as tests.

``mori.core`` is pure: it imports nothing from the other layers and no I/O or clock
library. Layers, each importing only those below it: core < protocol < traces, sim <
engines, enginesim < gateway, replay, sweep < cli. ``mori.protocol`` uses no third-party
library but Starlette and uvicorn; the simulator (``mori.sim``, the real-time engine
included) no HTTP library; the engine adapters (``mori.engines``) no simulator. The vLLM
plug-in (``mori.vllm_plugin``, loaded inside vLLM's processes) imports nothing else of
MORI but the pure eviction order (``mori.core.eviction_order`` and the enums it ranks),
and the others import only its protocol, which needs no vLLM. ruff and mypy (strict,
on the packages listed in pyproject.toml) must pass.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "mori" / "core"
FORBIDDEN = {"asyncio", "httpx", "aiohttp", "fastapi", "starlette", "uvicorn", "requests",
             "socket", "time", "datetime", "os", "io", "pathlib", "random", "subprocess",
             "threading", "multiprocessing", "mori.sim", "mori.traces", "mori.cli",
             "mori.engines", "mori.gateway"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: p.name)
def test_core_is_pure(path: Path) -> None:
    bad = {n for n in imports_of(path)
           if n in FORBIDDEN or any(n.startswith(f + ".") for f in FORBIDDEN)}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


# which layers each layer may import (imports flow one way, docs/architecture.md)
LAYERS = {
    "protocol": {"core"},
    "traces": {"core"},
    "sim": {"core", "protocol", "traces"},
    "engines": {"core", "protocol"},
    "enginesim": {"core", "protocol", "sim"},
    "replay": {"core", "protocol", "sim", "traces", "engines"},
    "dashboard": {"core", "sim", "traces"},
    "gateway": {"core", "protocol", "engines", "enginesim", "dashboard", "sim", "traces"},
    "sweep": {"core", "sim", "traces"},
    # MORI inside NVIDIA Dynamo: the gateway's control loop behind Dynamo's router API
    "dynamo": {"core", "protocol", "engines", "gateway"},
    # the label channel's engine end: messages, server, label table (neither engine)
    "plugin_channel": set(),
    # run inside vLLM's and SGLang's processes: nothing of MORI but themselves and the
    # label channel (and ENGINE_SIDE_CORE)
    "vllm_plugin": {"plugin_channel"},
    "sglang_plugin": {"plugin_channel"},
}
# what the engine-side layers (the label channel, the plug-ins) may import of the core:
# the one eviction order and the enums it ranks, pure and stdlib-only
ENGINE_SIDE_CORE = {"mori.core.eviction_order", "mori.core.types"}
# what the other layers may import of the plug-in: its protocol (it needs no vLLM; the
# engine adapters speak the label channel with it) and its connector config (`mori
# vllm-args` prints it; it checks the installed vLLM's release with compat); the rest runs
# only inside vLLM
PLUGIN_API = {"mori.vllm_plugin", "mori.plugin_channel", "mori.plugin_channel.protocol",
              "mori.plugin_channel.auth",  # both ends sign the channel's messages
              "mori.vllm_plugin.connector_config", "mori.vllm_plugin.compat",
              "mori.sglang_plugin", "mori.sglang_plugin.order"}
HTTP = {"starlette", "uvicorn", "aiohttp", "httpx", "requests", "fastapi", "openai",
        "prometheus_client"}


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / "src" / "mori" / package).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_one_way(layer: str) -> None:
    allowed = LAYERS[layer] | {layer}
    for path in package_files(layer):
        for name in imports_of(path):
            if name.startswith("mori."):
                if name in PLUGIN_API and layer != "protocol":
                    continue
                if name in ENGINE_SIDE_CORE:
                    continue
                other = name.split(".")[1]
                assert other in allowed, f"{path.relative_to(ROOT)} imports {name}"


def test_protocol_needs_only_starlette_uvicorn_and_msgspec() -> None:
    for path in package_files("protocol"):
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names or top in {"mori", "starlette", "uvicorn",
                                                             "msgspec"}, (
                f"{path.relative_to(ROOT)} imports {name}")


def test_vllm_plugin_imports_without_vllm() -> None:
    """The gateway side imports the plug-in's protocol where vLLM is not installed; the
    label tables, the typed queue and the release check need no vLLM either (only
    ``scheduler``, ``cpu_tier`` and ``host_tier`` do)."""
    code = ("import sys, mori.vllm_plugin, mori.plugin_channel.protocol, "
            "mori.plugin_channel.labels, mori.plugin_channel.server, "
            "mori.vllm_plugin.typed_queue, "
            "mori.vllm_plugin.connector_config, mori.vllm_plugin.compat; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_simulator_imports_no_http_library() -> None:
    for path in package_files("sim"):
        bad = {n for n in imports_of(path) if n.split(".")[0] in HTTP}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
    # nor through what it imports (the real-time engine raises the protocol's errors)
    code = ("import sys, mori.sim.realtime, mori.sim.runner; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HTTP)!r}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout


def test_ruff_clean() -> None:
    ruff = shutil.which("ruff")
    assert ruff, "ruff is a test dependency: pip install -e '.[test]'"
    res = subprocess.run([ruff, "check", "src", "tests", "bench", "scripts"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_strict_clean() -> None:
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_sglang_plugin_imports_without_sglang() -> None:
    """Only ``mori.sglang_plugin.backend`` imports SGLang: the gateway's adapter and
    ``mori sglang-args`` import the order and the routing key where SGLang is not
    installed."""
    code = ("import sys, mori, mori.sglang_plugin, mori.sglang_plugin.order, "
            "mori.cli.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch')))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def test_dynamo_is_imported_only_by_the_router_and_only_when_it_runs() -> None:
    """Only ``mori.dynamo.router`` imports NVIDIA Dynamo (its ``dynamo`` package), and only
    inside the functions that run in Dynamo's environment: the translation modules, the
    router module and ``mori dynamo-router --help`` import where Dynamo is not installed."""
    for path in package_files("dynamo"):
        tree = ast.parse(path.read_text(), str(path))
        top = {n for node in tree.body for n in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])}
        assert not {n for n in top if n.split(".")[0] in ("dynamo", "uvloop")}, (
            f"{path.relative_to(ROOT)} imports Dynamo at module level")
        if path.name != "router.py":
            assert not {n for n in imports_of(path) if n.split(".")[0] == "dynamo"}, path
    code = ("import sys, mori.dynamo.router, mori.dynamo.turn_handler, mori.cli.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dynamo'))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
