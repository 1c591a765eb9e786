#!/usr/bin/env bash
# Pre-rotary requests on the GPU machine (docs/rotary.md, issue #16): correctness, then the
# serving-path prefill at 32K tokens with the server-side rotary vs the five-variant path, the
# kernel times from nsys where it is installed, and the bytes of a 4096-token 7B prefill request.
# Build and bundle here:
#   bazel build //server:attnd //client:attnctl //tests:golden_cuda_test //kernels/cuda:rotary_cuda_test
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#       bazel-bin/tests/golden_cuda_test bazel-bin/kernels/cuda/rotary_cuda_test
#   (the bundle carries the golden cases; env.sh points TEST_SRCDIR at them)
# then there (from the repository root):
#   . .gpu/env.sh && bench/gpu/pre_rotary.sh "$OUT"
set -uo pipefail
out=${1:?usage: pre_rotary.sh OUT_DIR}
mkdir -p "$out"
status=0

rotary_cuda_test >"$out/rotary_cuda_test.log" 2>&1 || status=1
echo "rotary_cuda_test: $(grep -E 'PASSED|FAILED|SKIPP' "$out/rotary_cuda_test.log" | tail -3 | tr '\n' ' ')"
golden_cuda_test --gtest_filter='*PreRotary*' \
  >"$out/golden_cuda_test_pre_rotary.log" 2>&1 || status=1
echo "golden_cuda_test (pre-rotary): $(grep -E 'worst|PASSED|FAILED|SKIPP' \
  "$out/golden_cuda_test_pre_rotary.log" | tail -6 | tr '\n' ' ')"

# Bytes per 4096-token Qwen2.5-7B-1M prefill request in bf16 (tensor payload; gRPC adds ~100 B).
python3 - <<'PY' | tee "$out/request_bytes.txt"
t, hq, hkv, d, b = 4096, 28, 4, 128, 2
kv = 2 * t * hkv * d * b
print("variants:   q [4096,5,28,128] + k,v: %.1f MB" % ((t * 5 * hq * d * b + kv) / 1e6))
print("pre_rotary: q [4096,28,128]   + k,v: %.1f MB (target <= 45 MB)" % ((t * hq * d * b + kv) / 1e6))
PY

port=$((50100 + RANDOM % 1000))
attnd --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((32 << 30)) \
  --metrics-listen 127.0.0.1:0 >"$out/attnd.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
attnctl smoke --target 127.0.0.1:$port --q-layout pre_rotary --dtype bf16 >"$out/smoke_pre_rotary.log" 2>&1 ||
  status=1
echo "smoke pre_rotary (7B): $(tail -1 "$out/smoke_pre_rotary.log")"
for layout in variants pre_rotary; do
  attnctl bench --target 127.0.0.1:$port --q-layout $layout --context 32768 --prefill-chunk 4096 \
    --decode-steps 16 --batch 8 >"$out/bench_$layout.txt" 2>&1 || status=1
  echo "bench $layout: $(tail -1 "$out/bench_$layout.txt")"
done
kill "$pid"; wait "$pid" 2>/dev/null

# Kernel time: the prefill kernels plus, for pre_rotary, DualChunkRotaryKernel (nsys, if present).
if command -v nsys >/dev/null; then
  for layout in variants pre_rotary; do
    port=$((50100 + RANDOM % 1000))
    nsys profile -o "$out/nsys_$layout" --force-overwrite true -t cuda \
      attnd --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((32 << 30)) \
      --metrics-listen 127.0.0.1:0 --disable-cuda-graphs >"$out/attnd_nsys_$layout.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
    attnctl bench --target 127.0.0.1:$port --q-layout $layout --context 32768 --prefill-chunk 4096 \
      --decode-steps 1 >/dev/null 2>&1
    kill -INT "$pid"; wait "$pid" 2>/dev/null
    nsys stats -r cuda_gpu_kern_sum "$out/nsys_$layout.nsys-rep" >"$out/kernels_$layout.txt" 2>&1
    echo "kernels $layout: $(grep -E 'Prefill|Rotary|Convert' "$out/kernels_$layout.txt" | head -4 | tr -s ' ' | tr '\n' ';')"
  done
else
  echo "nsys not found: kernel times skipped (the bench rows above are serving-path times)"
fi
exit $status
