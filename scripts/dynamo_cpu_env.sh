#!/usr/bin/env bash
# Create (or reuse) a virtual environment holding NVIDIA Dynamo 1.6.1 (its frontend, its
# mocker engine and its router API) with MORI's dependencies, for `mori dynamo-router` and
# its end-to-end tests (tests/e2e/test_dynamo_router.py) on a machine without a GPU.
#
#   scripts/dynamo_cpu_env.sh            # prints the venv's path on its last line
#
# The venv lives at ${MORI_DYNAMO_VENV:-$HOME/.cache/mori/dynamo-venv} so that it is kept
# between runs on a machine that keeps its home folder; a stamp file inside it marks a
# complete install, and a second run with the stamp present only checks that Dynamo and
# MORI's dependencies import.
#
# What it installs (about 700 MB, under a minute with a reachable registry; no torch):
#   - ai-dynamo==1.6.1 and ai-dynamo-runtime==1.6.1 with --no-deps: ai-dynamo requires
#     aisimulate==0.13.0, a stub package that fetches its real self from a vendor index and
#     fails without it; nothing the frontend, the mocker or a router runs imports it.
#   - the rest of ai-dynamo's requirements by hand (its pins), and MORI's own runtime
#     dependencies (read from pyproject.toml), and pytest.
# MORI itself is not installed: the router runs with the checkout's src/ on PYTHONPATH
# (`PYTHONPATH=src $VENV/bin/python -m mori dynamo-router ...`), so one cached venv serves
# every checkout. pip reports "ai-dynamo 1.6.1 requires aisimulate": expected.
#
# Exit status: 0 ready; 2 an install step failed (registry unreachable, a package missing
# from the registry: outside the project); 1 anything else.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VENV="${MORI_DYNAMO_VENV:-$HOME/.cache/mori/dynamo-venv}"
DYNAMO_VERSION="${MORI_DYNAMO_VERSION:-1.6.1}"
PYTHON="${MORI_DYNAMO_PYTHON:-python3}"
STAMP="$VENV/.mori-dynamo-${DYNAMO_VERSION}.ok"

# ai-dynamo 1.6.1's Requires-Dist, less aisimulate (see the header).
DYNAMO_DEPS=(
    "aiohttp>=3.14.3,<4.0" "certifi>=2026.10.19" "kubernetes>=32.0.1,<33.0.0"
    "msgspec>=0.19.0" "prometheus-client>=0.23.1,<1.0" "pyzmq>=26.0.0"
    "redis>=6.2.0,<9.0.0" "tqdm>=4.0.0" "transformers>=4.56.0" "typing-extensions>=4.10.0"
    "zstandard>=0.23.0,<1.0" "pydantic>=2.10.6,<=2.13.5" "uvloop>=0.21.0"
)
CHECK_IMPORTS="import dynamo.frontend, dynamo.mocker, dynamo.llm, dynamo.runtime, \
starlette, aiohttp, msgspec, httptools, zmq, pytest"

say() { echo "[dynamo_cpu_env] $*" >&2; }
fail() {
    # fail CODE STEP MESSAGE
    say "FAILED at step '$2': $3"
    exit "$1"
}

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "$CHECK_IMPORTS" >/dev/null 2>&1; then
    say "reusing $VENV (ai-dynamo $DYNAMO_VERSION, installed $(cat "$STAMP"))"
    echo "$VENV"
    exit 0
fi

start=$(date +%s)
say "installing ai-dynamo $DYNAMO_VERSION into $VENV (about 700 MB)"

# Step 1: the virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$(dirname "$VENV")" || fail 1 "create venv" "cannot create $(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV" || fail 1 "create venv" "'$PYTHON -m venv $VENV' failed"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Step 2: the two Dynamo wheels without their requirements.
say "step: install ai-dynamo==$DYNAMO_VERSION ai-dynamo-runtime==$DYNAMO_VERSION (--no-deps)"
"${PIP[@]}" install --no-deps "ai-dynamo==${DYNAMO_VERSION}" "ai-dynamo-runtime==${DYNAMO_VERSION}" \
    || fail 2 "install ai-dynamo" "pip could not install ai-dynamo==$DYNAMO_VERSION (registry unreachable?)"

# Step 3: Dynamo's requirements (less aisimulate), MORI's runtime dependencies, pytest.
mapfile -t MORI_DEPS < <("$VENV/bin/python" - "$ROOT/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as fh:
    print("\n".join(tomllib.load(fh)["project"]["dependencies"]))
PY
) || fail 1 "read pyproject" "cannot read MORI's dependencies from $ROOT/pyproject.toml"
say "step: install Dynamo's and MORI's dependencies"
"${PIP[@]}" install "${DYNAMO_DEPS[@]}" "${MORI_DEPS[@]}" pytest \
    || fail 2 "install dependencies" "pip could not install: ${DYNAMO_DEPS[*]} ${MORI_DEPS[*]} pytest (registry unreachable, or a package missing from it)"

# Step 4: check the install.
say "step: check the install"
"$VENV/bin/python" -c "$CHECK_IMPORTS" >&2 \
    || fail 1 "check imports" "Dynamo's frontend, mocker or runtime does not import in $VENV"
PYTHONPATH="$ROOT/src" "$VENV/bin/python" -c "import mori.cli.main" >&2 \
    || fail 1 "check mori" "MORI does not import in $VENV with $ROOT/src on PYTHONPATH"

date -u +%Y-%m-%dT%H:%M:%SZ >"$STAMP"
say "done in $(( $(date +%s) - start )) s"
echo "$VENV"
