#!/usr/bin/env bash
# Install (or reuse) the agent CLIs that MORI's tests drive against a local endpoint:
# Claude Code (@anthropic-ai/claude-code), Codex (@openai/codex), Gemini CLI
# (@google/gemini-cli), opencode (opencode-ai) and Qwen Code (@qwen-code/qwen-code), at the
# exact versions pinned in tests/agents/package.json and tests/agents/package-lock.json.
#
#   scripts/agent_clis.sh              # prints the node_modules/.bin folder on its last line
#
# The install lives at ${MORI_CACHE:-$HOME/.cache/mori}/agent-clis/<KEY>, KEY being the first
# 16 hex digits of the sha256 of package-lock.json, so that a changed lock installs afresh
# beside the old one and an unchanged one is reused. package.json and the lock are copied
# there and `npm ci` runs there; a stamp file written only after the CLIs answer
# `--version` marks a complete install, so an interrupted one is redone. A lock file
# (flock, when the machine has it) keeps two runs at once from installing over each other.
#
# Claude Code, Codex and opencode ship their native binaries through per-platform optional
# dependencies (@anthropic-ai/claude-code-linux-x64, @openai/codex-linux-x64,
# opencode-linux-x64, ...), so npm alone is enough; Gemini CLI is a bundled Node.js script
# and Qwen Code JavaScript run by node. About 1.4 GB on disk. Claude Code's and opencode's
# postinstalls copy their binary over the bin/*.exe placeholder; if npm skipped install
# scripts, they are run here.
#
# Changing a pin: edit tests/agents/package.json, then `npm install --package-lock-only` in
# tests/agents. The lock must list every platform package of each CLI's
# optionalDependencies (npm ci refuses a lock that misses one, even for another platform);
# a registry mirror that lacks some of them makes npm leave them out silently. This lock's
# entries for opencode-ai's and @teddyzhu/clipboard's other-platform packages were added
# after npm's run for that reason (version, os, cpu, libc from the packages; no integrity,
# as npm never fetches them here).
#
# Exit status: 0 ready; 2 an install step failed for a reason outside the project (registry
# unreachable, a package missing from it); 3 node or npm is not installed; 1 anything else.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/tests/agents"
CACHE="${MORI_CACHE:-$HOME/.cache/mori}"

say() { echo "[agent_clis] $*" >&2; }
fail() {
    # fail CODE STEP MESSAGE
    say "FAILED at step '$2': $3"
    exit "$1"
}

command -v node >/dev/null 2>&1 \
    || fail 3 "find node" "node is not installed (Node.js 20 or later is needed)"
command -v npm >/dev/null 2>&1 || fail 3 "find npm" "npm is not installed"
[ -f "$SRC/package-lock.json" ] || fail 1 "find lock" "$SRC/package-lock.json is missing"

KEY="$(sha256sum "$SRC/package-lock.json" | cut -c1-16)"
DIR="$CACHE/agent-clis/$KEY"
BIN="$DIR/node_modules/.bin"
STAMP="$DIR/.mori-agent-clis.ok"

mkdir -p "$DIR" || fail 1 "create folder" "cannot create $DIR"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$DIR.lock" || fail 1 "lock" "cannot open $DIR.lock"
    flock 9 || fail 1 "lock" "cannot lock $DIR.lock"
fi

# Every CLI answers --version without touching the network or any configuration.
CLIS="claude codex gemini opencode qwen"
check_clis() {
    local cli
    for cli in $CLIS; do
        "$BIN/$cli" --version >/dev/null 2>&1 || return 1
    done
}

if [ -f "$STAMP" ] && check_clis; then
    say "reusing $DIR (installed $(cat "$STAMP"))"
    echo "$BIN"
    exit 0
fi

start=$(date +%s)
rm -f "$STAMP"
say "installing the agent CLIs into $DIR (about 1.4 GB)"

# Step 1: the manifest and the lock, as pinned in the tree.
cp "$SRC/package.json" "$SRC/package-lock.json" "$DIR/" \
    || fail 1 "copy manifest" "cannot copy into $DIR"

# Step 2: npm ci (removes any half-installed node_modules first). The native binaries are
# optional dependencies, included even where npm is configured to omit those. Claude Code
# declares node >= 22 but runs as a native binary, so npm's engine warning on Node 20 is
# harmless.
say "step: npm ci"
(cd "$DIR" && npm ci --include=optional --no-audit --no-fund --loglevel=error) >&2 \
    || fail 2 "npm ci" "npm could not install the pinned CLIs (registry unreachable, or a package \
missing from it)"

# Step 3: Claude Code's and opencode's native binaries. npm copies each over its placeholder
# in a postinstall script; run that script if npm was configured to skip install scripts.
if ! "$BIN/claude" --version >/dev/null 2>&1; then
    say "step: node install.cjs (Claude Code's postinstall did not run)"
    (cd "$DIR" && node node_modules/@anthropic-ai/claude-code/install.cjs) >&2 \
        || fail 1 "claude postinstall" "cannot put Claude Code's native binary in place"
fi
if ! "$BIN/opencode" --version >/dev/null 2>&1; then
    say "step: node postinstall.mjs (opencode's postinstall did not run)"
    (cd "$DIR/node_modules/opencode-ai" && node postinstall.mjs) >&2 \
        || fail 1 "opencode postinstall" "cannot put opencode's native binary in place"
fi

# Step 4: check every CLI answers.
say "step: check the CLIs"
for cli in $CLIS; do
    "$BIN/$cli" --version >&2 || fail 1 "check $cli" "'$BIN/$cli --version' fails"
done

date -u +%Y-%m-%dT%H:%M:%SZ >"$STAMP"
say "done in $(( $(date +%s) - start )) s"
echo "$BIN"
