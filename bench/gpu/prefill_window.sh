#!/usr/bin/env bash
# Prefill in key-tile windows (kernels/cuda/dca_cuda.h, CudaPrefillParams::key_tile_begin/end) on
# the GPU machine: the kernel tests (every window size's output byte for byte against the whole
# launch, and the refusals), then the whole launch against windows of 16-128 tiles for 4096-token
# 7B calls at 32K and 128K context, to pick the engine's default window.
# Build and bundle here:
#   bazel build //kernels/cuda:dca_cuda_test //bench/gpu:prefill_window_bench
#   script/gpu-bundle .gpu bazel-bin/kernels/cuda/dca_cuda_test bazel-bin/bench/gpu/prefill_window_bench
# then there (from the repository root):
#   . .gpu/env.sh && bench/gpu/prefill_window.sh "$OUT"
set -uo pipefail
out=${1:?usage: prefill_window.sh OUT_DIR}
mkdir -p "$out"
status=0

dca_cuda_test >"$out/dca_cuda_test.log" 2>&1 || status=1
echo "dca_cuda_test: $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$out/dca_cuda_test.log" | tr '\n' ' ')"
grep -E 'windows of|FAILED' "$out/dca_cuda_test.log" | head -60

prefill_window_bench --starts 28672,126976 --tokens 4096 --windows 16,32,64,128 --reps 5 \
  --out "$out/prefill_window_bench.txt" >/dev/null 2>"$out/prefill_window_bench.err" || {
  echo "prefill_window_bench failed:"
  cat "$out/prefill_window_bench.err"
  status=1
}
cat "$out/prefill_window_bench.txt" 2>/dev/null
exit $status
