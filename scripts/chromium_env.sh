#!/usr/bin/env bash
# Fetch (or reuse) a headless Chromium for the dashboard's browser tests (tests/dashboard),
# without root: Debian's chromium packages, downloaded with apt's ordinary client into a
# cache folder and unpacked there with `dpkg -x`; nothing is installed system-wide.
#
#   scripts/chromium_env.sh            # prints the browser's path on its last line
#
# The browser lives at ${MORI_CHROMIUM_DIR:-$HOME/.cache/mori/chromium} so that it is kept
# between runs on a machine that keeps its home folder; a stamp file inside it marks a
# complete install, and a second run with the stamp present only checks that it starts.
#
# What it does:
#   1. refreshes apt's package lists into the cache folder (apt-get update with private
#      Dir::State::Lists and Dir::Cache, and no lock: no root needed);
#   2. downloads chromium and chromium-common, and what apt would install with them here
#      (missing or too old; apt-get's simulation resolves it, without root), with
#      apt-get download;
#   3. unpacks them all into $DIR/root (dpkg -x) and writes $DIR/chromium, a wrapper that
#      puts the unpacked shared libraries on LD_LIBRARY_PATH and runs the browser;
#   4. checks that no shared library is missing (ldd) and that the browser renders a local
#      page headless (--headless --dump-dom).
#
# Exit status: 0 ready; 2 a download step failed (no apt-get or dpkg-deb, Debian's
# repositories unreachable: outside the project); 1 anything else (a missing library, a
# browser that does not start).
set -uo pipefail

DIR="${MORI_CHROMIUM_DIR:-$HOME/.cache/mori/chromium}"
ROOT="$DIR/root"
WRAPPER="$DIR/chromium"
STAMP="$DIR/.mori-chromium.ok"
PACKAGES=(chromium chromium-common)

say() { echo "[chromium_env] $*" >&2; }
fail() {
    # fail CODE STEP MESSAGE
    say "FAILED at step '$2': $3"
    exit "$1"
}

# Renders a local page headless; prints nothing, exits non-zero when the page is not seen.
check_launch() {
    local page="$DIR/check.html" out
    echo '<html><body><p id="m">mori-chromium-ok</p></body></html>' >"$page"
    out=$(timeout 120 "$WRAPPER" --headless --no-sandbox --disable-gpu --no-first-run \
        --disable-dev-shm-usage --user-data-dir="$DIR/check-profile" \
        --dump-dom "file://$page" 2>"$DIR/check.log")
    rm -rf "$DIR/check-profile"
    grep -q 'mori-chromium-ok' <<<"$out"
}

if [ -f "$STAMP" ] && [ -x "$WRAPPER" ] && check_launch; then
    say "reusing $WRAPPER ($(cat "$STAMP"))"
    echo "$WRAPPER"
    exit 0
fi

command -v apt-get >/dev/null || fail 2 "find apt" "apt-get is not on PATH (a Debian-based machine is needed)"
command -v dpkg-deb >/dev/null || fail 2 "find dpkg" "dpkg-deb is not on PATH"
start=$(date +%s)
mkdir -p "$DIR/lists/partial" "$DIR/cache/archives/partial" "$DIR/debs" \
    || fail 1 "create folders" "cannot create $DIR"
APT=(apt-get -q -o "Dir::State::Lists=$DIR/lists" -o "Dir::Cache=$DIR/cache"
     -o Debug::NoLocking=1)

# Step 1: package lists of our own (the system's may be stale, and are not ours to write).
say "step: apt-get update (lists in $DIR/lists)"
"${APT[@]}" update >"$DIR/update.log" 2>&1 \
    || fail 2 "apt-get update" "could not refresh the package lists (Debian's repositories unreachable?); see $DIR/update.log"

# Step 2: chromium, and whatever apt would install with it on this machine (what is missing
# or too old here): apt-get's simulation, which needs no root, resolves that.
say "step: resolve dependencies"
"${APT[@]}" -s install --no-install-recommends "${PACKAGES[@]}" >"$DIR/resolve.log" 2>&1 \
    || fail 2 "resolve dependencies" "apt-get cannot resolve ${PACKAGES[*]}; see $DIR/resolve.log"
mapfile -t extra < <(awk '$1 == "Inst" {print $2}' "$DIR/resolve.log")
wanted=("${PACKAGES[@]}")
for pkg in "${extra[@]}"; do
    case " ${wanted[*]} " in *" $pkg "*) ;; *) wanted+=("$pkg") ;; esac
done
say "step: download ${#wanted[@]} packages: ${wanted[*]}"
rm -f "$DIR"/debs/*.deb
(cd "$DIR/debs" && "${APT[@]}" download "${wanted[@]}") >"$DIR/download.log" 2>&1 \
    || fail 2 "apt-get download" "could not download ${wanted[*]}; see $DIR/download.log"

# Step 3: unpack, and the wrapper.
say "step: unpack into $ROOT"
rm -rf "$ROOT"
mkdir -p "$ROOT"
for deb in "$DIR"/debs/*.deb; do
    dpkg-deb -x "$deb" "$ROOT" || fail 1 "unpack" "dpkg-deb -x $deb failed"
done
[ -x "$ROOT/usr/lib/chromium/chromium" ] \
    || fail 1 "unpack" "no $ROOT/usr/lib/chromium/chromium in the unpacked packages"
# libpulse0 keeps libpulsecommon in a subfolder its RUNPATH names absolutely (the system's
# /usr/lib/x86_64-linux-gnu/pulseaudio, absent where libpulse0 is not installed)
LIBS="$ROOT/usr/lib/chromium:$ROOT/usr/lib/x86_64-linux-gnu:$ROOT/usr/lib/x86_64-linux-gnu/pulseaudio:$ROOT/lib/x86_64-linux-gnu:$ROOT/usr/lib"
cat >"$WRAPPER" <<EOF
#!/bin/sh
# Debian's Chromium unpacked by scripts/chromium_env.sh; its libraries are not installed.
export LD_LIBRARY_PATH="$LIBS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$ROOT/usr/lib/chromium/chromium" "\$@"
EOF
chmod +x "$WRAPPER"

# Step 4: every shared library found, and a page rendered.
say "step: check shared libraries"
missing=$(LD_LIBRARY_PATH="$LIBS" ldd "$ROOT/usr/lib/chromium/chromium" 2>&1 | grep 'not found' || true)
[ -z "$missing" ] || fail 1 "check libraries" "libraries missing (a package this script does not fetch): $missing"
say "step: render a page headless"
check_launch || fail 1 "launch" "the browser did not render a local page; see $DIR/check.log"

rm -rf "$DIR/debs" "$DIR/cache"
date -u +%Y-%m-%dT%H:%M:%SZ >"$STAMP"
say "done in $(( $(date +%s) - start )) s"
echo "$WRAPPER"
