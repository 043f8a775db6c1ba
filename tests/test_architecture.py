"""The layering of ARCHITECTURE.md, and the static checks, as tests.

``mori.core`` is pure: it imports nothing from the other layers and no I/O or clock
library. ruff and mypy (strict, on the packages listed in pyproject.toml) must pass.
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


# which layers each layer may import (imports flow one way, ARCHITECTURE.md)
LAYERS = {
    "traces": {"core"},
    "sim": {"core", "traces"},
    "engines": {"core", "sim", "traces"},
    "replay": {"core", "sim", "traces", "engines"},
    "gateway": {"core", "engines"},
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_one_way(layer: str) -> None:
    allowed = LAYERS[layer] | {layer}
    for path in sorted((ROOT / "src" / "mori" / layer).rglob("*.py")):
        for name in imports_of(path):
            if name.startswith("mori."):
                other = name.split(".")[1]
                assert other in allowed, f"{path.relative_to(ROOT)} imports {name}"


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
