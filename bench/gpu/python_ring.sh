#!/usr/bin/env bash
# The Python client's shared-memory ring (Client.ring) next to the C++ client's ring and Python
# unary Decode, on one CUDA attnd (7B geometry, bf16, one layer, 4K context): per-layer decode
# p50 / p99 at batch 1, 8, 32 (bench/python/ring_bench.py runs attnctl bench --transport ring on
# the same daemon after each batch's Python rounds), then the Python ring's own work per call with
# no server. Targets (docs/BENCHMARKS.md, "Python ring"): Python ring p50 within 10 us of the C++
# ring's at batch 1; Python decode at batch 32 within 1.2x of the C++ client's.
# Build and bundle here:
#   bazel build //server:attnd //client:attnctl
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl
# then there, from the repository root:  . .gpu/env.sh && bench/gpu/python_ring.sh
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
port=${PORT:-50778}
context=${CONTEXT:-4096}
attnd --device cuda --listen 127.0.0.1:$port --metrics-listen= --kv-cache-bytes 48Gi >/tmp/attnd_pyring.log 2>&1 &
pid=$!
for _ in $(seq 1 300); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for version in ${VERSIONS:-1 2}; do
    echo "== round $round, ring version $version"
    python3 "$here/bench/python/ring_bench.py" --target 127.0.0.1:$port --attnctl "$(command -v attnctl)" \
      --batch "${BATCHES:-1,8,32}" --context "$context" --chunk 1024 --calls 1000 --rounds 2 \
      --ring-version "$version" || status=1
  done
done
kill -TERM $pid; wait $pid
exit $status
