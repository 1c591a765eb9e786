#!/usr/bin/env bash
# Decode throughput of one layer with N concurrent batch-1 loopback clients (default 1,4,16,64),
# with and without cross-RPC decode batching, for the tiny model and the Qwen2.5-7B-1M geometry
# (the default model) at a 256-token context. Each configuration starts its own attnd.
#   bench/batching/run.sh [clients]
set -euo pipefail
cd "$(dirname "$0")/../.."
CLIENTS="${1:-1,4,16,64}"
bazel build //server:attnd //bench/batching:batching_bench >&2
PORT="${PORT:-50061}"
BENCH=bazel-bin/bench/batching/batching_bench

run() {  # label kv_cache_bytes attnd-flags...
  local label="$1" kv="$2"
  shift 2
  bazel-bin/server/attnd --listen "127.0.0.1:${PORT}" --kv-cache-bytes "$kv" --log-level warn "$@" &
  local pid=$!
  for _ in $(seq 100); do  # until it answers GetServerInfo
    "$BENCH" --target "127.0.0.1:${PORT}" --clients "" >/dev/null 2>&1 && break
    sleep 0.1
  done
  "$BENCH" --target "127.0.0.1:${PORT}" --clients "$CLIENTS" --context 256 --label "$label" \
    --server_pid "$pid" || true
  kill "$pid"
  wait "$pid" || true
}

TINY=(--model-config configs/tiny/config.json)
run "batching=off" $((256 << 20)) "${TINY[@]}" --decode-batching=false
run "batching=on" $((256 << 20)) "${TINY[@]}"
run "batching=on,inflight=2" $((256 << 20)) "${TINY[@]}" --decode-batches-in-flight=2
run "batching=off" $((3 << 30)) --decode-batching=false
run "batching=on" $((3 << 30))
run "batching=on,inflight=2" $((3 << 30)) --decode-batches-in-flight=2
