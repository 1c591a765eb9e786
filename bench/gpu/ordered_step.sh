#!/usr/bin/env bash
# Where a device-ordered ring step's time goes between two processes on one GPU: attnctl's
# ring-cuda-ipc decode (7B, bf16, pre-rotary, 4K context, one layer) at batch 1 and 8, device-ordered
# (--ring-device-events: the step is timed until the device ran it) and host-synchronized, first as
# the processes run by default (two CUDA contexts time-sliced), then under CUDA MPS (one shared
# context, when nvidia-cuda-mps-control is there and may start), with the transformers decode
# (bench/python/hf_bench.py --parts decode) in the MPS run too. On the H100 a device-ordered batch-1
# step took ~0.3 ms against 0.04 ms synchronized (docs/BENCHMARKS.md, "int8 KV on CUDA, and
# device-ordered decodes behind gates"): if MPS removes that, the cost is the context hand-off.
# Bundle attnd and attnctl (script/gpu-bundle), then there:
#   . .gpu/env.sh && bench/gpu/ordered_step.sh OUT_DIR
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: ordered_step.sh OUT_DIR}
mkdir -p "$out"
rings() {  # label
  local port=$((50300 + RANDOM % 500))
  attnd --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((16 << 30)) --metrics-listen= \
    >"$out/attnd_$1.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
  for b in 1 8; do
    for mode in ordered synced; do
      local extra=""
      [[ $mode == ordered ]] && extra=--ring-device-events
      timeout 60 attnctl bench --target 127.0.0.1:$port --transport ring-cuda-ipc --ring-regions $extra \
        --context 4096 --batch $b --layers 1 --dtype bf16 --q-layout pre_rotary --decode-steps 300 \
        >"$out/ring_$1_${mode}_b$b.txt" 2>&1
      echo "$1 $mode batch $b: $(grep -E '^ +4096' "$out/ring_$1_${mode}_b$b.txt")"
    done
  done
  kill "$pid"
  wait "$pid" 2>/dev/null
}
rings contexts
if ! command -v nvidia-cuda-mps-control >/dev/null; then
  echo "no nvidia-cuda-mps-control: the MPS half is skipped"
  exit 0
fi
export CUDA_MPS_PIPE_DIRECTORY=$out/mps_pipe CUDA_MPS_LOG_DIRECTORY=$out/mps_log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if ! nvidia-cuda-mps-control -d; then
  echo "MPS did not start: the MPS half is skipped"
  exit 0
fi
rings mps
timeout 200 python3 "$here/bench/python/hf_bench.py" --attnd "$(command -v attnd)" --parts decode \
  --shapes 1x4096,8x4096,32x4096 >"$out/transformers_decode_mps.txt" 2>&1
grep -E '^decode' "$out/transformers_decode_mps.txt" | cut -c1-300
echo quit | nvidia-cuda-mps-control
