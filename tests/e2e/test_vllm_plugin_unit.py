"""The MORI vLLM plug-in's own tests (``tests/vllm_inside``), run inside vLLM's venv, on
every supported release (``conftest.VLLM_RELEASES``: the CPU build, and 0.33's and 0.34's
source over it); and the canary for the next release (``scripts/vllm_canary.sh``).

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

from mori.vllm_plugin import compat

from .conftest import (
    CPU_BUILD,
    ENGINE_RELEASES,
    ROOT,
    SCRIPTS,
    VLLM_RELEASES,
    _install_venv,
    release_env,
)

pytestmark = pytest.mark.e2e

TIMEOUT_S = 900


def test_the_tested_releases_are_the_supported_ones() -> None:
    assert sorted(compat.release(r) for r in VLLM_RELEASES) == sorted(compat.SUPPORTED)
    # a real engine runs on the CPU build and on every release it can (not 0.34: x86
    # without triton-cpu); the newest supported release is among the in-engine ones
    assert CPU_BUILD in ENGINE_RELEASES and set(ENGINE_RELEASES) <= set(VLLM_RELEASES)
    newest = max(compat.SUPPORTED, key=lambda r: tuple(map(int, r.split("."))))
    assert newest in {compat.release(r) for r in VLLM_RELEASES}


@pytest.mark.parametrize("release", VLLM_RELEASES)
def test_plugin_tests_pass_inside_vllms_venv(release: str) -> None:
    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    venv = _install_venv()
    over = release_env(release)
    path = ":".join(p for p in (str(ROOT / "src"), over.pop("PYTHONPATH", "")) if p)
    env = {**os.environ, **over, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop(compat.UNVERIFIED_ENV, None)
    python = str(venv / "bin" / "python")
    got = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    version = (got.stdout.strip().splitlines() or ["?"])[-1]
    assert compat.release(version) == compat.release(release), (
        f"vLLM {release} was asked for, {version} imports:\n{got.stderr[-3000:]}")
    if release == CPU_BUILD:
        assert not over, over
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "--confcutdir", "tests/vllm_inside",
           "-W", "ignore::DeprecationWarning", "tests/vllm_inside"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"tests/vllm_inside on vLLM {version} took over {TIMEOUT_S} s:\n"
                    f"{e.stdout or ''}", pytrace=False)
    out = (proc.stdout + proc.stderr)[-12000:]
    print(out, file=sys.stderr)
    assert proc.returncode == 0, (
        f"tests/vllm_inside failed on vLLM {version} inside {venv} (exit "
        f"{proc.returncode}):\n{out}")
    assert " skipped" not in out.splitlines()[-1], f"tests were skipped on {version}:\n{out}"


def test_the_canary_prints_one_line_for_the_newest_supported_release() -> None:
    """``scripts/vllm_canary.sh VERSION`` (without VERSION: the newest on PyPI) builds the
    release's overlay (reused here: the test above built it), runs tests/vllm_inside on it
    and ends with one line: the release, supported or not, the counts, the first failure."""
    if os.environ.get("MORI_SKIP_VLLM") == "1":
        pytest.skip("MORI_SKIP_VLLM=1: the real-vLLM tests are skipped")
    newest = max(VLLM_RELEASES[1:], key=lambda r: tuple(map(int, r.split("."))))
    env = {k: v for k, v in os.environ.items() if k != compat.UNVERIFIED_ENV}
    proc = subprocess.run(["bash", str(SCRIPTS / "vllm_canary.sh"), newest], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                          check=False)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 1, (
        f"exit {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    line = lines[0]
    assert line.startswith(f"vllm-canary: vLLM {newest} (asked for): supported "
                           f"({compat.supported_text()}); tests/vllm_inside: "), line
    assert line.endswith(" passed; first failure: none"), line
    assert "failed" not in line and "skipped" not in line and "error" not in line, line
