#!/usr/bin/env bash
# Decode throughput of one layer, 1/4/16/64 concurrent batch-1 clients over loopback, with and
# without cross-RPC decode batching, for the tiny model and the Qwen2.5-7B-1M geometry at short
# context. Usage: bench/batching/run.sh [clients, default 1,4,16,64]
set -euo pipefail
cd "$(dirname "$0")/../.."
CLIENTS="${1:-1,4,16,64}"
bazel build //server:attnd //bench/batching:batching_bench >&2
PORT=50061

run() {  # label model_config kv_bytes context -- extra attnd flags
  local label="$1" config="$2" kv="$3" context="$4"
  shift 4
  bazel-bin/server/attnd --listen "127.0.0.1:${PORT}" ${config:+--model-config "$config"} \
    --kv-cache-bytes "$kv" --log-level warn "$@" &
  local pid=$!
  for _ in $(seq 100); do
    bazel-bin/bench/batching/batching_bench --target "127.0.0.1:${PORT}" --clients "" \
      >/dev/null 2>&1 && break
    sleep 0.1
  done
  bazel-bin/bench/batching/batching_bench --target "127.0.0.1:${PORT}" --clients "$CLIENTS" \
    --context "$context" --label "$label" || true
  kill "$pid"
  wait "$pid" || true
}

for mode in on off; do
  if [[ $mode == on ]]; then flags=(--decode-batching=true); else flags=(--decode-batching=false); fi
  run "batching=$mode" configs/tiny/config.json $((256 << 20)) 256 "${flags[@]}"
done
for mode in on off; do
  if [[ $mode == on ]]; then flags=(--decode-batching=true); else flags=(--decode-batching=false); fi
  run "batching=$mode" "" $((3 << 30)) 256 "${flags[@]}"
done
