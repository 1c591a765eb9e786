#!/usr/bin/env bash
# Decode throughput of one layer on the CUDA backend with N concurrent batch-1 loopback clients,
# with and without cross-RPC batching (7B geometry, 4096-token contexts). Bundled binaries:
#   gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/bench/batching/batching_bench
#   . .gpu/env.sh && bench/gpu/batching_cuda.sh
set -uo pipefail
for mode in false true; do
  port=$((52000 + RANDOM % 1000))
  attnd --device cuda --listen 127.0.0.1:$port --metrics-listen 127.0.0.1:0 --log-level warn \
    --kv-cache-bytes $((32 << 30)) --decode-batching=$mode &
  pid=$!
  for _ in $(seq 1 300); do
    batching_bench --target 127.0.0.1:$port --clients "" >/dev/null 2>&1 && break
    sleep 0.2
  done
  batching_bench --target 127.0.0.1:$port --clients 1,4,16,64 --context 4096 --min_seconds 2 \
    --label "cuda batching=$mode" --server_pid $pid
  kill -TERM $pid; wait $pid
done
