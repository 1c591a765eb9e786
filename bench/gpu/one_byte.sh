#!/usr/bin/env bash
# The one-byte KV caches (int8, fp8 E4M3) on one GPU, in one call: the engine test, the decode
# kernel beside bf16 (lab_bench --one-byte: speed at every case, fp8 at forced ring depths, and each
# phase's clock cycles per warp tile), the engine step (decode_step_bench), and what an fp8 or int8
# cache costs the dense and sparse prefill in accuracy at 128K and 1M tokens (sparse_bench). Raw
# output in OUT_DIR, a summary on stdout. Build and bundle here:
#   bazel build //server/engine:cuda_engine_one_byte_kv_test //bench/gpu/lab:lab_bench \
#     //bench/gpu:decode_step_bench //bench/gpu:sparse_bench
#   script/gpu-bundle .gpu bazel-bin/server/engine/cuda_engine_one_byte_kv_test \
#     bazel-bin/bench/gpu/lab/lab_bench bazel-bin/bench/gpu/decode_step_bench \
#     bazel-bin/bench/gpu/sparse_bench
# then there, from the repository root (sparse_bench reads configs/):
#   . .gpu/env.sh && bench/gpu/one_byte.sh "$OUT"
# About 5 minutes on an H100 (the dense 1M prefill is most of it; SKIP_1M=1 leaves it out).
set -uo pipefail
out=${1:?usage: one_byte.sh OUT_DIR}
mkdir -p "$out"
start=$(date +%s)
el() { echo "[$(($(date +%s) - start)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.txt"
status=0

el "engine test"
timeout 150 cuda_engine_one_byte_kv_test >"$out/one_byte_kv_test.log" 2>&1 || status=1
grep -E '^\[  (PASSED|FAILED) |^golden' "$out/one_byte_kv_test.log"

el "decode kernel: lab_bench --one-byte"
timeout 240 lab_bench --decode-only --decode-configs none --one-byte --out "$out/lab_one_byte.txt" \
  >/dev/null 2>&1 || status=1
sed -n '/one-byte KV/,$p' "$out/lab_one_byte.txt"

el "engine step: decode_step_bench"
for spec in "4096 1,64,128" "32768 8,32"; do
  set -- $spec
  timeout 120 decode_step_bench --context "$1" --batches "$2" --kv_dtype bf16,int8,fp8 \
    --capture_layers 0 --iters 200 >"$out/decode_step_$1.txt" 2>&1 || status=1
  grep -A4 "vs bf16" "$out/decode_step_$1.txt"
done

el "prefill accuracy: sparse_bench"
sizes=131072,1048576
[[ -n ${SKIP_1M:-} ]] && sizes=131072
for dtype in fp8 int8; do
  timeout 240 sparse_bench --sizes "$sizes" --layers 17 --dense 1 --kv-dtype "$dtype" \
    --out "$out/sparse_$dtype.txt" >/dev/null 2>&1 || status=1
  grep -E "KV, " "$out/sparse_$dtype.txt"
  sizes=131072  # int8 at 128K only: the 1M dense run is the slow part
done
el done
exit $status
