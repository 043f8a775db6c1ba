"""The MORI SGLang plug-in's own tests (``tests/sglang_inside``), run inside SGLang's venv
on SGLang's real cache classes (SGLang 0.5.23 with CPU tensors; its server does not run
on these CPUs, ``shared/ENGINES.md``).

The venv comes from ``scripts/sglang_cpu_env.sh`` (cached at ``$MORI_SGLANG_VENV`` or
``~/.cache/mori/sglang-venv``, about 2.5 GB); ``MORI_SKIP_SGLANG=1`` skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, _install_venv

pytestmark = pytest.mark.e2e

TIMEOUT_S = 600


def _sglang_venv() -> Path:
    return _install_venv("sglang_cpu_env.sh", "SGLang's CPU venv")


def test_plugin_tests_pass_inside_sglangs_venv() -> None:
    if os.environ.get("MORI_SKIP_SGLANG") == "1":
        pytest.skip("MORI_SKIP_SGLANG=1: the tests on SGLang's classes are skipped")
    venv = _sglang_venv()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SGLANG_PLUGINS": "none"}
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-p", "no:cacheprovider",
           "--confcutdir", "tests/sglang_inside", "-W", "ignore::DeprecationWarning",
           "tests/sglang_inside"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"tests/sglang_inside took over {TIMEOUT_S} s:\n{e.stdout or ''}",
                    pytrace=False)
    out = (proc.stdout + proc.stderr)[-12000:]
    print(out, file=sys.stderr)
    assert proc.returncode == 0, f"tests/sglang_inside failed inside SGLang's venv:\n{out}"
    summary = out.strip().splitlines()[-1]  # "16 passed in 9.1s" (pyproject's -q)
    assert " passed" in summary and " skipped" not in summary, out


def test_the_order_benchmark_runs_inside_sglangs_venv() -> None:
    """bench/bench_sglang_order.py on a short loop: its table, MORI's column beside LRU's
    (not timed: its figures are in docs/sglang-gpu.md with their command)."""
    if os.environ.get("MORI_SKIP_SGLANG") == "1":
        pytest.skip("MORI_SKIP_SGLANG=1: the tests on SGLang's classes are skipped")
    venv = _sglang_venv()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SGLANG_PLUGINS": "none"}
    proc = subprocess.run([str(venv / "bin" / "python"), "bench/bench_sglang_order.py",
                           "--rounds", "60", "--pool-ratio", "0.3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().endswith("%")
            or line.split()[-1].replace(".", "").isdigit()]
    assert rows and "MORI cached" in proc.stdout, proc.stdout
