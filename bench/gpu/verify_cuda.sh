#!/usr/bin/env bash
# Every gpu-tagged test plus the end-to-end run (e2e_cuda.sh), from one GPU-machine call; logs in
# OUT_DIR/logs.tgz, a summary on stdout. Build and bundle here:
#   bazel build //server:attnd //client:attnctl //kernels/cuda:dca_cuda_test \
#     //kernels/cuda:attention_tile_test \
#     //bench/gpu/lab:lab_test //kernels/cuda:rotary_cuda_test //kernels/cuda:sparse_cuda_test \
#     //server/engine:cuda_engine_test //server/engine:sharded_engine_cuda_test \
#     //server/engine:cuda_engine_sparse_test //server/engine:cuda_engine_one_byte_kv_test \
#     //server/engine:engine_factory_test //tests:golden_cuda_test //tests:sparse_golden_cuda_test
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#     bazel-bin/kernels/cuda/dca_cuda_test bazel-bin/kernels/cuda/attention_tile_test \
#     bazel-bin/bench/gpu/lab/lab_test \
#     bazel-bin/kernels/cuda/rotary_cuda_test bazel-bin/kernels/cuda/sparse_cuda_test \
#     bazel-bin/server/engine/cuda_engine_test bazel-bin/server/engine/sharded_engine_cuda_test \
#     bazel-bin/server/engine/cuda_engine_sparse_test bazel-bin/server/engine/cuda_engine_one_byte_kv_test \
#     bazel-bin/server/engine/engine_factory_test bazel-bin/tests/golden_cuda_test \
#     bazel-bin/tests/sparse_golden_cuda_test
#   strip .gpu/bin/*   (the bundle carries the golden cases; env.sh points the tests at them)
# then there:  . .gpu/env.sh && bench/gpu/verify_cuda.sh "$OUT"
# (python_cuda.sh, run last, needs python3 with torch, grpcio and numpy there.)
set -uo pipefail
out=${1:?usage: verify_cuda.sh OUT_DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
logs=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
status=0
for t in attention_tile_test dca_cuda_test lab_test rotary_cuda_test sparse_cuda_test \
  cuda_engine_test sharded_engine_cuda_test cuda_engine_sparse_test cuda_engine_one_byte_kv_test \
  engine_factory_test sparse_golden_cuda_test; do
  "$t" >"$logs/$t.log" 2>&1
  rc=$?
  ((rc == 0)) || status=1
  echo "$t: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$logs/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]|SKIPPING|worst max abs' "$logs/$t.log" | head -10
done
"$here/bench/gpu/e2e_cuda.sh" "$logs/e2e" || status=1
"$here/bench/gpu/python_cuda.sh" "$logs/python" || status=1
tar czf "$out/logs.tgz" -C "$logs" .
exit $status
