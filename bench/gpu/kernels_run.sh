#!/usr/bin/env bash
# The kernel work of issues 3 and 4 from one GPU-machine call: prefill variants (tests, bench, torch
# SDPA peer), decode variants (tests, bench), the sparse kernels (tests; sparse vs dense prefill at
# 128K-1M with the current dense default), and the CUDA engine tests with the sparse golden case over
# gRPC. Build and bundle here:
#   bazel build //bench/gpu/lab:lab_test //bench/gpu/lab:lab_bench //kernels/cuda:sparse_cuda_test \
#     //bench/gpu:sparse_bench //server/engine:cuda_engine_test //tests:sparse_golden_cuda_test
#   script/gpu-bundle .gpu bazel-bin/kernels/cuda/dca_cuda_test \
#     bazel-bin/bench/gpu/lab/lab_bench bazel-bin/kernels/cuda/sparse_cuda_test \
#     bazel-bin/bench/gpu/sparse_bench bazel-bin/server/engine/cuda_engine_test \
#     bazel-bin/tests/sparse_golden_cuda_test
#   strip .gpu/bin/*   (the bundle carries the golden cases; env.sh points the tests at them)
# then there:  . .gpu/env.sh && bench/gpu/kernels_run.sh "$OUT"
# OUT_DIR gets prefill/ (2 files), decode.tgz, sparse_bench.txt and logs.tgz.
set -uo pipefail
out=${1:?usage: kernels_run.sh OUT_DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
logs=$(mktemp -d)
status=0
SECONDS=0
timeout 200 "$here/bench/gpu/lab/prefill_variants.sh" "$out/prefill" 5,9,11,12,13,14 none || status=1
echo "[kernels_run +${SECONDS}s] prefill done"
timeout 150 "$here/bench/gpu/lab/decode_variants.sh" "$logs/decode" || status=1
tar czf "$out/decode.tgz" -C "$logs" decode
echo "[kernels_run +${SECONDS}s] decode done"
for t in sparse_cuda_test cuda_engine_test sparse_golden_cuda_test; do
  timeout 120 "$t" >"$logs/$t.log" 2>&1
  rc=$?
  ((rc == 0)) || status=1
  echo "$t: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$logs/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]|SKIPPING|worst max abs' "$logs/$t.log" | head -10
done
echo "[kernels_run +${SECONDS}s] tests done"
timeout 200 sparse_bench --sizes 131072,262144,524288,1048576 --layers 17 --band smooth \
  --out "$out/sparse_bench.txt" >"$logs/sparse_bench.log" 2>&1 || { echo "sparse_bench failed"; status=1; }
tail -25 "$out/sparse_bench.txt" 2>/dev/null
echo "[kernels_run +${SECONDS}s] sparse bench done"
tar czf "$out/logs.tgz" -C "$logs" --exclude=decode .
exit $status
