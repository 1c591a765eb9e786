#!/usr/bin/env bash
# Decode variants (issue #3) from one GPU-machine call: the decode tests of lab_test (every
# kDecodeConfigs entry against the fp64 CPU reference and the simple kernel), then lab_bench's
# decode-variant sweep (batch {1,8,32,128} x ctx {4K,32K,128K} + 1 x 1M, and the copy ceiling).
# Logs under OUT_DIR; test summary, per-variant worst errors and the bench table on stdout.
# About 30-40 s of GPU time (the bench fills a 34 GB KV pool once). Build and bundle here:
#   bazel build //bench/gpu/lab:lab_test //bench/gpu/lab:lab_bench
#   script/gpu-bundle .gpu-d bazel-bin/bench/gpu/lab/lab_test \
#       bazel-bin/bench/gpu/lab/lab_bench
# then on the GPU machine (carry .gpu-d):
#   . .gpu-d/env.sh && bench/gpu/lab/decode_variants.sh "$OUT" [VARIANTS, default 0,2,3,4,5]
set -uo pipefail
out=${1:?usage: decode_variants.sh OUT_DIR [VARIANTS]}
variants=${2:-0,2,3,4,5}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,memory.total \
  --format=csv >"$out/env.txt" 2>&1
status=0
SECONDS=0
timeout 120 lab_test --gtest_filter='Shapes/DecodeTest.*:CudaKernelPlan.*:CudaGeometry.*' \
  >"$out/dca_cuda_test_decode.log" 2>&1
rc=$?
((rc == 0)) || status=1
echo "lab_test (decode): exit $rc in ${SECONDS}s; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' \
  "$out/dca_cuda_test_decode.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]|SKIPPING|Failure' "$out/dca_cuda_test_decode.log" | head -20
# Worst error per variant over every case and split count (vs fp64, and vs the simple kernel).
awk '/max_abs=/ {
       if (!match($0, / c[0-9]+ w[0-9]+s[0-9]+ [a-z]+/)) next;
       key = substr($0, RSTART + 1, RLENGTH - 1) (index($0, "vs simple") ? " vs simple" : " vs fp64");
       split($0, f, "max_abs="); split(f[2], g, " "); mx = g[1] + 0;
       split($0, h, "mean_abs="); mn = h[2] + 0;
       if (mx > worst[key]) worst[key] = mx; if (mn > mean[key]) mean[key] = mn; n[key]++ }
     END { for (k in worst) printf "  %-32s runs=%-4d worst max_abs=%.3g worst mean_abs=%.3g\n",
           k, n[k], worst[k], mean[k] }' "$out/dca_cuda_test_decode.log" | sort
SECONDS=0
timeout 240 lab_bench --decode-only --decode-configs "$variants" --out "$out/lab_bench_decode.txt" \
  >/dev/null 2>"$out/lab_bench.err"
rc=$?
((rc == 0)) || { echo "lab_bench failed (exit $rc):"; tail -5 "$out/lab_bench.err"; status=1; }
echo "lab_bench --decode-only: ${SECONDS}s"
grep -E '^# lab_bench|^D2D copy' "$out/lab_bench_decode.txt" 2>/dev/null
grep -E '^(batch|[0-9]+ +[0-9]+ )' "$out/lab_bench_decode.txt" 2>/dev/null |
  awk '$NF != "max_diff" && ($NF + 0 > 0.01 || $NF == "inf" || $NF == "nan") {
         print "  max_diff above 0.01 (vs the first variant): " $0 }'
sed -n '/^## Decode variants summary/,$p' "$out/lab_bench_decode.txt" 2>/dev/null
# SASS of the decode kernels (CPU only; this checkout's build machine has no cuobjdump): per kernel,
# the copy, matrix, local-memory and barrier instruction counts; full SASS in the log folder.
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$(command -v lab_bench)" 2>/dev/null |
    awk '/Function : .*DcaDecode(Split|Pipe)Kernel/ { name = $3 }
         /Function : / && !/DcaDecode(Split|Pipe)Kernel/ { name = "" }
         name != "" { print > "/dev/stderr"; for (i = 1; i <= NF; ++i) if ($i ~ /^(LDGSTS|UBLKCP|LDL|STL|HMMA|LDSM|BAR|SYNCS|LDG)/) { split($i, op, "."); c[name " " op[1]]++ } }
         END { for (k in c) print k, c[k] }' 2>"$out/decode_sass.txt" | sort >"$out/decode_sass_summary.txt"
  echo "decode SASS counts (kernel opcode count; LDL/STL should be absent):"
  sed 's/_ZN5attnd12cuda_kernels//' "$out/decode_sass_summary.txt" | grep -E 'Pipe|Split' | head -60 |
    awk '{k = $1; sub(/EEEvNS0_10DecodeArgsE/, "", k); line[k] = line[k] " " $2 "=" $3 }
         END { for (k in line) print "  " k ":" line[k] }' | sort
fi
exit $status
