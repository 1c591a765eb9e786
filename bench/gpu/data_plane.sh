#!/usr/bin/env bash
# The data plane (#15) and pre-rotary requests (#16) on the GPU machine, in one call: the CUDA
# tests (golden cases unary, Session, shm and CUDA IPC regions), the engine alone on
# device-resident inputs and the rotary kernel alone, then the serving path per transport
# (bench/data_plane/data_plane_bench.cc) against a daemon on the same host. Build and bundle here:
#   bazel build //server:attnd //client:attnctl //bench/data_plane:data_plane_bench \
#     //bench/gpu:decode_step_bench //kernels/cuda:rotary_cuda_test //server/engine:cuda_engine_test \
#     //tests:golden_cuda_test //tests:sparse_golden_cuda_test
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#     bazel-bin/bench/data_plane/data_plane_bench bazel-bin/bench/gpu/decode_step_bench \
#     bazel-bin/kernels/cuda/rotary_cuda_test bazel-bin/server/engine/cuda_engine_test \
#     bazel-bin/tests/golden_cuda_test bazel-bin/tests/sparse_golden_cuda_test
# then there:  . .gpu/env.sh && bench/gpu/data_plane.sh "$OUT"
set -uo pipefail
out=${1:?usage: data_plane.sh OUT_DIR}
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nproc | sed 's/^/cores: /'

for t in rotary_cuda_test cuda_engine_test golden_cuda_test sparse_golden_cuda_test; do
  "$t" >"$out/$t.log" 2>&1
  rc=$?
  ((rc == 0)) || status=1
  echo "$t: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]|worst max abs' "$out/$t.log" | head -30
done

echo "## the engine alone (device-resident inputs), and the rotary kernel alone"
data_plane_bench --engine --q_layout pre_rotary --contexts 16384,32768,131072 2>&1 |
  tee "$out/engine_pre_rotary.txt"
data_plane_bench --engine --q_layout variants --contexts 16384,32768,131072 --skip_decode 2>&1 |
  tee "$out/engine_variants.txt"
decode_step_bench --context 4096 --batches 1,8,64 --capture_layers 0 >"$out/decode_step.txt" 2>&1
tail -12 "$out/decode_step.txt"

echo "## the serving path per transport"
port=$((50100 + RANDOM % 1000))
attnd --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((40 << 30)) \
  --metrics-listen 127.0.0.1:0 >"$out/attnd.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
data_plane_bench --target 127.0.0.1:$port --contexts 16384,131072 2>&1 | tee "$out/serving_pre_rotary.txt"
((PIPESTATUS[0] == 0)) || status=1
data_plane_bench --target 127.0.0.1:$port --skip_prefill --decode_q_layout variants \
  --transports grpc,ring 2>&1 | tee "$out/serving_decode_variants.txt"
data_plane_bench --target 127.0.0.1:$port --q_layout variants --skip_decode \
  --contexts 16384,32768 2>&1 | tee "$out/serving_variants.txt"
data_plane_bench --target 127.0.0.1:$port --skip_decode --contexts 32768 --transports grpc,cuda-ipc \
  2>&1 | tee "$out/serving_pre_rotary_32k.txt"
timeout 150 attnctl smoke --target 127.0.0.1:$port --q-layout pre_rotary --dtype bf16 \
  --max-tokens 20000 >"$out/smoke_pre_rotary.log" 2>&1 || status=1
echo "smoke pre_rotary (7B, 20000 tokens): $(tail -1 "$out/smoke_pre_rotary.log")"
kill "$pid"
wait "$pid" 2>/dev/null
tail -3 "$out/attnd.log"
exit $status
