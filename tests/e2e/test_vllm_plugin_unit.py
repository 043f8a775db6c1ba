"""The MORI vLLM plug-in's own tests (``tests/vllm_inside``), run inside vLLM's venv.

They need vLLM's real classes (``BlockPool``, ``Scheduler``, ``Request``), which the
project's venv does not have, so they run in a subprocess with the vLLM venv's python
(made by ``scripts/vllm_cpu_env.sh``, as for the other end-to-end tests; ``MORI_SKIP_VLLM=1``
skips). No engine is started.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .conftest import ROOT, _install_venv

pytestmark = pytest.mark.e2e

TIMEOUT_S = 900


def test_plugin_tests_pass_inside_vllms_venv() -> None:
    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    venv = _install_venv()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    cmd = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--confcutdir", "tests/vllm_inside",
           "-W", "ignore::DeprecationWarning", "tests/vllm_inside"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"tests/vllm_inside took over {TIMEOUT_S} s:\n{e.stdout or ''}",
                    pytrace=False)
    out = (proc.stdout + proc.stderr)[-12000:]
    print(out, file=sys.stderr)
    assert proc.returncode == 0, (
        f"tests/vllm_inside failed inside {venv} (exit {proc.returncode}):\n{out}")
