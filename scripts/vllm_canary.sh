#!/usr/bin/env bash
# The canary for the next vLLM release: does the MORI plug-in fit the newest vLLM on PyPI
# (what `pip install vllm` gets today)?
#
#   scripts/vllm_canary.sh            # the newest release
#   scripts/vllm_canary.sh 0.34.0     # a given one
#
# It resolves the newest release (`pip index versions vllm`), lays its Python source over
# the cached vLLM CPU build (scripts/vllm_release_overlay.sh; a download of about 340 MB,
# kept under ~/.cache/mori/vllm-overlays), runs the plug-in's in-engine tests
# (tests/vllm_inside) on it and prints ONE final line on stdout:
#
#   vllm-canary: vLLM 0.34.0 (newest on PyPI): supported (0.32.x, 0.33.x, 0.34.x); tests/vllm_inside: 97 passed; first failure: none
#   vllm-canary: vLLM 0.35.0 (newest on PyPI): NOT supported (0.32.x, 0.33.x, 0.34.x); tests/vllm_inside: 9 failed, 88 passed; first failure: tests/vllm_inside/test_contract.py::test_cache_policy_method_set - AssertionError: CachePolicy's methods changed in 0.35.0: new ['...'], ...
#
# For a release the plug-in does not support, the tests run with MORI_VLLM_UNVERIFIED=1
# (past the release check; the hook check still runs, so a hook that moved shows up), the
# contract tests hold it to the newest supported release's pins, and the two tests that
# only say "this release is not in compat.SUPPORTED" are left out: the first failure is
# what moved. A real engine on that release still refuses to start with the plug-in, in
# one line naming the release and `mori vllm-args --no-plugin`.
#
# Time: under 5 minutes with the CPU venv cached (scripts/vllm_cpu_env.sh), most of it the
# download; a second run reuses the overlay (about a minute).
#
# Exit status: 0 the release is supported and its tests pass; 1 it is not supported, or a
# test failed; 2 something outside the project (registry unreachable).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WANT="${1:-latest}"
TIMEOUT_S="${MORI_CANARY_TIMEOUT_S:-900}"
LOG="$(mktemp -t vllm-canary.XXXXXX)"
trap 'rm -f "$LOG"' EXIT

line() { echo "vllm-canary: $*"; }

VENV="$(bash "$ROOT/scripts/vllm_cpu_env.sh" 2>"$LOG" | tail -n 1)"
if [ -z "$VENV" ] || [ ! -x "$VENV/bin/python" ]; then
    line "no vLLM CPU venv (scripts/vllm_cpu_env.sh failed): $(tail -n 1 "$LOG")"
    exit 2
fi
PY="$VENV/bin/python"

OVERLAY="$(bash "$ROOT/scripts/vllm_release_overlay.sh" "$WANT" 2>"$LOG" | tail -n 1)"
rc=$?
if [ $rc -ne 0 ] || [ ! -d "$OVERLAY/vllm" ]; then
    line "vLLM $WANT: no overlay (scripts/vllm_release_overlay.sh): $(grep FAILED "$LOG" | tail -n 1)"
    [ $rc -eq 2 ] && exit 2
    exit 1
fi
VERSION="$(basename "$OVERLAY")"
if [ "$WANT" = latest ]; then
    WHICH="newest on PyPI"
else
    WHICH="asked for"
fi

# supported or not: the plug-in's own list (mori.vllm_plugin.compat imports no vLLM)
read -r SUPPORTED LIST < <(PYTHONPATH="$ROOT/src" "$PY" - "$VERSION" <<'EOF'
import sys
from mori.vllm_plugin import compat
print("yes" if compat.is_supported(sys.argv[1]) else "no", compat.supported_text())
EOF
)
if [ "$SUPPORTED" = yes ]; then
    VERDICT="supported ($LIST)"
    EXTRA=()
    UNVERIFIED=0
else
    VERDICT="NOT supported ($LIST)"
    EXTRA=(--deselect tests/vllm_inside/test_contract.py::test_vllm_release_is_one_verified
           --deselect tests/vllm_inside/test_refusal.py::test_the_supported_release_installed_here_loads)
    UNVERIFIED=1
fi

cd "$ROOT" || exit 1
env -u MORI_VLLM_UNVERIFIED \
    PYTHONPATH="$ROOT/src:$OVERLAY:$OVERLAY/deps" VLLM_TARGET_DEVICE=cpu \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 COLUMNS=400 \
    $( [ $UNVERIFIED -eq 1 ] && echo MORI_VLLM_UNVERIFIED=1 ) \
    timeout "$TIMEOUT_S" "$PY" -m pytest -rfE -p no:cacheprovider \
    --confcutdir tests/vllm_inside -W ignore::DeprecationWarning "${EXTRA[@]}" \
    tests/vllm_inside >"$LOG" 2>&1
rc=$?

# pytest's counts ("3 failed, 90 passed, 2 deselected in 41.2s") and its first failure
COUNTS="$(grep -E '^[=]* *[0-9]+ (passed|failed|error)' "$LOG" | tail -n 1 \
    | sed -E 's/^=* *//; s/ in [0-9.]+s.*$//; s/ *=*$//')"
FIRST="$(grep -m 1 -E '^(FAILED|ERROR) ' "$LOG" | sed -E 's/^(FAILED|ERROR) //')"
if [ $rc -eq 124 ]; then
    FIRST="${FIRST:-the tests took over $TIMEOUT_S s}"
elif [ $rc -ne 0 ] && [ -z "$FIRST" ]; then
    # a collection error or a crash: its last words
    FIRST="pytest exited $rc: $(grep -E 'Error|error' "$LOG" | tail -n 1)"
fi
line "vLLM $VERSION ($WHICH): $VERDICT; tests/vllm_inside: ${COUNTS:-no result}; first failure: ${FIRST:-none}"
[ $rc -eq 0 ] && [ "$SUPPORTED" = yes ] && exit 0
exit 1
