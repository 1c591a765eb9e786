#!/usr/bin/env bash
# Sparse prefill calls of any size through the CUDA engine (docs/DCA.md "Vertical-slash sparse
# prefill"): correctness of staged calls, then the per-token time of 5,957-, 8,192- and
# 16,384-token calls ending at 128K context on the 7B geometry, through the default 512 MiB
# staging (5,957 tokens) and through staging that holds 16,384 tokens. Target: the 8,192- and
# 16,384-token calls no slower per token than the 5,957-token one. Kernel-only baseline of one
# 5,957-token call: sparse_bench --sizes 131072 --chunk 5957. Build and bundle here:
#   bazel build //server/engine:cuda_engine_sparse_test //bench/gpu:sparse_bench
#   script/gpu-bundle .gpu bazel-bin/server/engine/cuda_engine_sparse_test \
#       bazel-bin/bench/gpu/sparse_bench
# then there (from the repository root):
#   . .gpu/env.sh && bench/gpu/sparse_calls.sh "$OUT"
set -uo pipefail
out=${1:?usage: sparse_calls.sh OUT_DIR}
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
cuda_engine_sparse_test >"$out/cuda_engine_sparse_test.log" 2>&1 || status=1
grep -E '^\[  (PASSED|FAILED|SKIPPED) |SKIPPING|us/token|over_2e-2' \
  "$out/cuda_engine_sparse_test.log"
sparse_bench --sizes 131072 --layers 17 --chunk 5957 --dense 0 \
  >"$out/sparse_bench_chunk5957.log" 2>&1 || status=1
tail -5 "$out/sparse_bench_chunk5957.log"
exit $status
