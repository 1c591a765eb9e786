#!/usr/bin/env bash
# Decode batching on the CUDA backend, everything from one GPU-machine call (docs/batching.md):
#   1. cuda_engine_test: engine correctness, including graph replay == eager launch, bit for bit;
#   2. decode_step_bench: one decode step of one layer, graphs vs eager, batch 1/8/32/128 at 4K,
#      plus batch 1 at 256 tokens (the engine time the RPC overhead is measured against), and
#      the start-up cost of capturing graphs for 28 layers;
#   3. batching_bench against attnd --device cuda: decode throughput of one layer with 1/4/16/64
#      concurrent batch-1 loopback clients, with and without cross-RPC batching, over unary
#      Decode RPCs and over Session streams (context 256 tokens; client p50/p99 latencies), with
#      one and with two batches in flight per layer.
# Build and bundle here:
#   bazel build //server:attnd //server/engine:cuda_engine_test //bench/gpu:decode_step_bench \
#       //bench/batching:batching_bench
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/server/engine/cuda_engine_test \
#       bazel-bin/bench/gpu/decode_step_bench bazel-bin/bench/batching/batching_bench
# then on the GPU machine:  . .gpu/env.sh && bench/gpu/batching_cuda.sh "$OUT"
# Options (environment): DTYPE=bf16 makes the clients send bf16 tensors (default fp32);
# BATCHING_ONLY=1 skips steps 1 and 2.
set -uo pipefail
out=${1:?usage: batching_cuda.sh OUT_DIR}
mkdir -p "$out"
status=0
dtype=${DTYPE:-fp32}
if [[ ${BATCHING_ONLY:-0} != 1 ]]; then

cuda_engine_test >"$out/cuda_engine_test.log" 2>&1 || status=1
echo "cuda_engine_test: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/cuda_engine_test.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]|Failure|SKIPPING' "$out/cuda_engine_test.log" | head -20

{
  decode_step_bench --context 4096 --batches 1,8,32,128 --iters 300 --capture_layers 28
  decode_step_bench --context 256 --batches 1 --iters 1000 --capture_layers 0
} >"$out/decode_step_bench.txt" 2>&1 || { echo "decode_step_bench failed"; status=1; }
grep -vE '^\[' "$out/decode_step_bench.txt" | grep -E 'summary|batch|start-up|captured' | head -30
grep -E 'captured' "$out/decode_step_bench.txt" | head -3
fi

# "false": no cross-RPC batching; "true1": the batcher with one batch in flight per layer;
# "true2": two in flight (--decode-batches-in-flight's default).
for batching in false true1 true2; do
  port=$((52000 + RANDOM % 1000))
  t0=$(date +%s%N)
  extra=()
  [[ $batching == true1 ]] && extra=(--decode_batches_in_flight 1)
  [[ $batching == true2 ]] && extra=(--decode_batches_in_flight 2)
  attnd --device cuda --listen 127.0.0.1:$port --metrics-listen 127.0.0.1:0 --log-level info \
    --kv-cache-bytes $((32 << 30)) --decode-batching=${batching%[12]} "${extra[@]}" \
    >"$out/attnd_batching_$batching.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    batching_bench --target 127.0.0.1:$port --clients "" >/dev/null 2>&1 && break
    sleep 0.1
  done
  echo "attnd decode-batching=$batching: serving after $((($(date +%s%N) - t0) / 1000000)) ms"
  for mode in --nosession --session; do
    batching_bench --target 127.0.0.1:$port --clients 1,4,16,64 --context 256 --decodes 200 \
      --min_seconds 0.5 --max_rounds 2 --label "cuda batching=$batching" --server_pid $pid $mode \
      --dtype "$dtype" \
      2>&1 | tee -a "$out/batching_bench.txt"
  done
  kill -TERM $pid
  wait $pid
  grep -E 'captured|warn|error' "$out/attnd_batching_$batching.log" | head -5
done
exit $status
