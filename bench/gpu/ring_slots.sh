#!/usr/bin/env bash
# Micro-batches in flight on one ring: attnctl bench over the ring with CUDA IPC region references
# (ring-cuda-ipc, host-synchronized), each decode step's batch sent as S micro-batches in flight
# at once (--ring-slots S) against the one-batch round trip (S = 1), at 4K context, the daemon's
# default 7B geometry, one layer, bf16, pre-rotary q; beside it in the same run the engine alone
# (data_plane_bench --engine). Rounds alternate the slot counts. Build and bundle here:
#   bazel build //server:attnd //client:attnctl //bench/data_plane:data_plane_bench
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#     bazel-bin/bench/data_plane/data_plane_bench
# then there:  . .gpu/env.sh && bench/gpu/ring_slots.sh OUT_DIR
set -uo pipefail
out=${1:?usage: ring_slots.sh OUT_DIR}
mkdir -p "$out"
status=0
batches=${BATCHES:-8,64,128}
slots=${SLOTS:-1 2 4}
rounds=${ROUNDS:-2}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"

echo "## the engine alone (Engine::Decode in-process, host inputs)"
data_plane_bench --engine --skip_prefill --decode_context 4096 --decode_batches "$batches" \
  --decode_q_layout pre_rotary 2>&1 | tee "$out/engine_decode.txt"
((PIPESTATUS[0] == 0)) || status=1

port=$((50100 + RANDOM % 1000))
attnd --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((64 << 30)) \
  --metrics-listen 127.0.0.1:0 >"$out/attnd.log" 2>&1 &
pid=$!
for _ in $(seq 1 900); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
for round in $(seq 1 "$rounds"); do
  for batch in ${batches//,/ }; do
    for s in $slots; do
      echo "## round $round batch $batch slots $s" | tee -a "$out/attnctl_bench.txt"
      attnctl bench --target 127.0.0.1:$port --transport ring-cuda-ipc --ring-regions \
        --ring-slots "$s" --context 4096 --batch "$batch" --layers 1 --dtype bf16 \
        --q-layout pre_rotary --decode-steps 300 2>>"$out/attnctl.err" |
        tee -a "$out/attnctl_bench.txt" | grep -E "^ +4096"
      ((PIPESTATUS[0] == 0)) || status=1
    done
  done
done
kill "$pid"
wait "$pid" 2>/dev/null
tail -3 "$out/attnd.log"
exit $status
