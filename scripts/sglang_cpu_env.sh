#!/usr/bin/env bash
# Create (or reuse) a virtual environment in which SGLang's own KV radix-cache classes
# (sglang.srt.mem_cache: RadixCache, UnifiedRadixCache, the HiCache host pools, the
# registry and the eviction strategies) import and run on CPU tensors. SGLang's server does
# not start on CPU; this venv is for driving the cache classes in-process (tests, probes).
#
#   scripts/sglang_cpu_env.sh            # prints the venv's path on its last line
#
# The venv lives at ${MORI_SGLANG_VENV:-$HOME/.cache/mori/sglang-venv} so that it is kept
# between runs on a machine that keeps its home folder; a stamp file inside it marks a
# complete install, and a second run with the stamp present only checks that the cache
# modules import and that pytest is there.
#
# What it installs (about 2.5 GB, about 2 minutes with a warm pip cache), instead of the
# full `pip install sglang==0.5.23` (11 GB: CUDA torch, nvidia-* libraries, flashinfer):
#   - torch==2.13.0+cpu. PyPI has no "+cpu" torch; pip finds it in a local wheel folder or
#     index when the machine has one (pip's find-links / extra-index-url configuration), or
#     in $MORI_TORCH_WHEEL if that names the wheel file.
#   - sglang==0.5.23 and torchvision==0.28.0 with --no-deps (their requirements would pull
#     CUDA torch 2.14.1 back in), then only the modules the mem_cache import chain reaches
#     (found by importing and adding what was missing), under a constraint that keeps torch
#     at the CPU build; sglang's own pins where it has them.
#   - pytest and httptools, for tests that run inside this venv (MORI's adapters import
#     httptools).
#   - _mori_torchvision_cpu_shim.pth: PyPI's torchvision _C is linked against CUDA torch and
#     does not load beside torch+cpu, after which `import torchvision` fails with "operator
#     torchvision::nms does not exist"; SGLang imports torchvision.transforms at module level
#     (sglang.srt.configs -> multimodal.internvl_utils), which every mem_cache module
#     reaches. The shim defines the two op schemas (no kernels) on the first
#     `import torchvision`, and only when torchvision's _C does not load.
# pip reports "sglang 0.5.23 requires ..., which is not installed" conflicts: expected.
#
# Exit status: 0 ready; 2 an install step failed (registry unreachable, a package missing
# from the registry or the local wheel folder: outside the project); 1 anything else.
set -uo pipefail

VENV="${MORI_SGLANG_VENV:-$HOME/.cache/mori/sglang-venv}"
SGLANG_VERSION="${MORI_SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${MORI_TORCH_VERSION:-2.13.0}"
TORCHVISION_VERSION="${MORI_TORCHVISION_VERSION:-0.28.0}"
PYTHON="${MORI_SGLANG_PYTHON:-python3}"
STAMP="$VENV/.mori-sglang-cpu-${SGLANG_VERSION}.ok"

# What the mem_cache import chain needs beyond torch (sglang's pins where it pins).
DEPS=(
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic
    pyzmq tqdm IPython aiohttp dill partial_json_parser gguf
    "triton==3.9.0"
    "transformers==5.19.0" "tokenizers==0.23.2" "kernels>=0.14.1,<0.15"
    "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0"
    "openai==2.8.0"
)
# The modules this venv exists for; checked after the install and on reuse.
CHECK_IMPORTS="import torch, sglang.srt.mem_cache.radix_cache, sglang.srt.mem_cache.registry, \
sglang.srt.mem_cache.evict_policy, sglang.srt.mem_cache.memory_pool, sglang.srt.mem_cache.allocator, \
sglang.srt.mem_cache.unified_radix_cache, sglang.srt.mem_cache.pool_host.common, \
sglang.srt.mem_cache.pool_host.mha, sglang.srt.managers.cache_controller, \
sglang.srt.managers.schedule_batch, sglang.srt.server_args; \
assert '+cpu' in torch.__version__, torch.__version__"

say() { echo "[sglang_cpu_env] $*" >&2; }
fail() {
    # fail CODE STEP MESSAGE
    say "FAILED at step '$2': $3"
    exit "$1"
}

# The tests inside this venv: pytest; and httptools, which MORI's engine adapters import
# (the tests drive the plug-in's label channel with the gateway's own adapter).
ensure_test_tools() {
    if ! "$VENV/bin/python" -c "import pytest, httptools" >/dev/null 2>&1; then
        say "step: install pytest httptools"
        "$VENV/bin/python" -m pip --disable-pip-version-check install -c "$VENV/mori-constraints.txt" pytest httptools \
            || fail 2 "install pytest" "pip could not install pytest and httptools (registry unreachable?)"
    fi
}

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "$CHECK_IMPORTS" >/dev/null 2>&1; then
    say "reusing $VENV (sglang $SGLANG_VERSION on torch+cpu, installed $(cat "$STAMP"))"
    ensure_test_tools
    echo "$VENV"
    exit 0
fi

start=$(date +%s)
say "installing sglang $SGLANG_VERSION (mem_cache only) on torch+cpu into $VENV (about 2.5 GB)"

# Step 1: the virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")" || fail 1 "create venv" "cannot create $(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV" || fail 1 "create venv" "'$PYTHON -m venv $VENV' failed"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# Keeps every later install from replacing the CPU torch with PyPI's CUDA build.
echo "torch==${TORCH_VERSION}" >"$VENV/mori-constraints.txt" \
    || fail 1 "write constraints" "cannot write $VENV/mori-constraints.txt"

# Step 2: torch, CPU build, asked for alone so that a missing local wheel is named plainly.
torch_spec="torch==${TORCH_VERSION}"
if [ -n "${MORI_TORCH_WHEEL:-}" ]; then
    torch_spec="$MORI_TORCH_WHEEL"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('${TORCH_VERSION}+cpu') else 1)" >/dev/null 2>&1; then
    say "step: install torch ($torch_spec)"
    "${PIP[@]}" install "$torch_spec" \
        || fail 2 "install torch" "pip could not install $torch_spec (the CPU build comes from a local wheel folder or index; set MORI_TORCH_WHEEL to the wheel file if pip does not find it; or the registry is unreachable)"
fi
"$VENV/bin/python" -c "import torch; assert '+cpu' in torch.__version__, torch.__version__" \
    || fail 1 "check torch" "the torch installed in $VENV is not a CPU build"

# Step 3: sglang and torchvision without their requirements.
say "step: install sglang==$SGLANG_VERSION torchvision==$TORCHVISION_VERSION (--no-deps)"
"${PIP[@]}" install --no-deps "sglang==${SGLANG_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    || fail 2 "install sglang" "pip could not install sglang==$SGLANG_VERSION / torchvision==$TORCHVISION_VERSION (registry unreachable?)"

# Step 4: the modules the mem_cache import chain reaches, and pytest.
say "step: install the mem_cache dependencies and pytest"
"${PIP[@]}" install -c "$VENV/mori-constraints.txt" "${DEPS[@]}" pytest httptools \
    || fail 2 "install dependencies" "pip could not install: ${DEPS[*]} pytest (registry unreachable, or a package missing from it)"

# Step 5: the torchvision shim (see the header).
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    || fail 1 "torchvision shim" "cannot find the venv's site-packages"
cat >"$site/_mori_torchvision_cpu_shim.py" <<'EOF'
"""Lets PyPI's torchvision import beside a CPU-only torch (written by MORI's
scripts/sglang_cpu_env.sh).

PyPI's torchvision _C is linked against CUDA torch; beside torch+cpu it does not load, and
torchvision's _meta_registrations then calls register_fake on torchvision::nms and
torchvision::qnms, which _C would have defined: `import torchvision` raises "operator
torchvision::nms does not exist". SGLang imports torchvision.transforms at module level.
This finder runs once, on the first `import torchvision`: it tries to load torchvision's _C
and, only if that fails, defines the two op schemas (no kernels). It imports nothing until
then.
"""
import sys


class _TorchvisionCpuShim:
    done = False

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision" or _TorchvisionCpuShim.done:
            return None
        _TorchvisionCpuShim.done = True
        try:
            import glob
            import importlib.machinery
            import os

            import torch

            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.origin is None:
                return None
            for so in glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so")):
                try:
                    torch.ops.load_library(so)
                    return None  # a torchvision built for this torch: no shim needed
                except Exception:
                    pass
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _TorchvisionCpuShim.lib = lib  # keep the fragment alive
        except Exception:
            pass
        return None


sys.meta_path.insert(0, _TorchvisionCpuShim())
EOF
[ $? -eq 0 ] || fail 1 "torchvision shim" "cannot write $site/_mori_torchvision_cpu_shim.py"
echo "import _mori_torchvision_cpu_shim" >"$site/_mori_torchvision_cpu_shim.pth" \
    || fail 1 "torchvision shim" "cannot write $site/_mori_torchvision_cpu_shim.pth"

# Step 6: check that the cache modules import, on the CPU torch.
say "step: check the install"
"$VENV/bin/python" -W ignore -c "$CHECK_IMPORTS; import sglang; print('sglang', sglang.__version__, 'torch', torch.__version__)" >&2 \
    || fail 1 "check imports" "the sglang.srt.mem_cache modules do not import in $VENV"
ensure_test_tools

date -u +%Y-%m-%dT%H:%M:%SZ >"$STAMP"
say "done in $(( $(date +%s) - start )) s"
echo "$VENV"
