#!/usr/bin/env bash
# Unary decode with CUDA IPC region tensors (attnctl bench --transport cuda-ipc: q/k/v and o in
# device buffers shared by cudaIpcGetMemHandle) next to gRPC bytes, at batch 1, 8 and 64 (the
# daemon's default 7B geometry, 4K context, bf16, one layer). With ATTND_BEFORE=/path/to/attnd it
# runs that binary ("before") and the attnd on PATH ("after") in turn, two interleaved rounds, a
# fresh daemon each. Build and bundle here (a CUDA build, so attnctl has cuda-ipc):
#   bazel build //server:attnd //client:attnctl
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl
# then there:  . .gpu/env.sh && bench/gpu/ipc_decode.sh OUT_DIR
set -uo pipefail
out=${1:?usage: ipc_decode.sh OUT_DIR}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
status=0
run() {  # name attnd-binary
  local name=$1 bin=$2 port=$((50100 + RANDOM % 1000))
  "$bin" --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((40 << 30)) \
    --metrics-listen 127.0.0.1:0 >"$out/attnd_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 900); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
  for batch in 1 8 64; do
    echo "## $name batch $batch"
    attnctl bench --target 127.0.0.1:$port --transport grpc,cuda-ipc --context 4096 \
      --batch $batch --layers 1 --dtype bf16 --decode-steps 200 2>/dev/null || status=1
  done
  kill "$pid"
  wait "$pid" 2>/dev/null
}
for round in 1 2; do
  [[ -n ${ATTND_BEFORE:-} ]] && run "before_$round" "$ATTND_BEFORE" | tee -a "$out/bench.txt"
  run "after_$round" attnd | tee -a "$out/bench.txt"
done
exit $status
