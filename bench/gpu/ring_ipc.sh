#!/usr/bin/env bash
# Decode over the ring with CUDA IPC region references (q/k/v and o in device buffers shared by
# cudaIpcGetMemHandle, as a serving stack on the same GPU would send them) at batch 1, 8, 64 and
# 128, 4K context, the daemon's default 7B geometry, one layer, bf16; beside it in the same run the
# engine alone (in-process, no transport), gRPC bytes, shm references and the ring with inline
# bytes. Build and bundle here (a CUDA build, so attnctl and data_plane_bench have CUDA IPC):
#   bazel build //server:attnd //client:attnctl //bench/data_plane:data_plane_bench
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#     bazel-bin/bench/data_plane/data_plane_bench
# then there:  . .gpu/env.sh && bench/gpu/ring_ipc.sh OUT_DIR
set -uo pipefail
out=${1:?usage: ring_ipc.sh OUT_DIR}
mkdir -p "$out"
status=0
batches=1,8,64,128
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
nproc | sed 's/^/cores: /'

echo "## the engine alone (Engine::Decode in-process, host inputs)"
data_plane_bench --engine --skip_prefill --decode_context 4096 --decode_batches $batches 2>&1 |
  tee "$out/engine_decode.txt"
((PIPESTATUS[0] == 0)) || status=1

echo "## the serving path"
port=$((50100 + RANDOM % 1000))
# 128 sequences of 4K tokens through all 28 layers' pages need about 32 GiB of KV.
attnd --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((64 << 30)) \
  --metrics-listen 127.0.0.1:0 >"$out/attnd.log" 2>&1 &
pid=$!
for _ in $(seq 1 900); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
for layout in pre_rotary variants; do
  data_plane_bench --target 127.0.0.1:$port --skip_prefill --decode_context 4096 \
    --decode_batches $batches --decode_q_layout $layout --transports grpc,shm,ring,ring-cuda-ipc \
    2>&1 | tee "$out/serving_decode_$layout.txt"
  ((PIPESTATUS[0] == 0)) || status=1
done
# attnctl: "ring" carries shm references (--ring-regions), so ring and ring-cuda-ipc differ only
# in where the tensors are; region transports check their outputs against gRPC's bytes first.
for batch in 1 8 64 128; do
  echo "## attnctl batch $batch" | tee -a "$out/attnctl_bench.txt"
  attnctl bench --target 127.0.0.1:$port --transport grpc,ring,cuda-ipc,ring-cuda-ipc \
    --ring-regions --context 4096 --batch $batch --layers 1 --dtype bf16 --decode-steps 200 \
    2>>"$out/attnctl.err" | tee -a "$out/attnctl_bench.txt"
  ((PIPESTATUS[0] == 0)) || status=1
done
kill "$pid"
wait "$pid" 2>/dev/null
tail -3 "$out/attnd.log"
exit $status
