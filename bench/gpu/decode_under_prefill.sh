#!/usr/bin/env bash
# Decode while other clients prefill (docs/scheduling.md): per-layer decode p50/p99 at batch 1, 8
# and 64 (4K context, 7B geometry, pre-rotary bf16) over the ring and gRPC unary, first alone, then
# while a prefill stream sends 128K-token prompts in 4096-token calls through CUDA IPC regions;
# and the prefill stream's throughput alone and beside the decodes. One attnd per run, started
# with the flags given after OUT (e.g. --prefill-step-keys 1000000000 for whole calls); ATTND
# names another attnd binary (e.g. an older build) to compare. DEVICE=cpu PREFILL_TRANSPORT=grpc
# CONTEXT=4096 CHUNK=1024 DECODE_CONTEXT=2048 BATCHES=1,8 runs the same on the CPU backend
# (attnd and data_plane_bench from bazel-bin on PATH). Build and bundle here:
#   bazel build //server:attnd //client:attnctl //bench/data_plane:data_plane_bench
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#     bazel-bin/bench/data_plane/data_plane_bench
# then there:  . .gpu/env.sh && LABEL=default bench/gpu/decode_under_prefill.sh "$OUT" [flags]
set -uo pipefail
out=${1:?usage: decode_under_prefill.sh OUT_DIR [attnd flags...]}
shift
label=${LABEL:-run}
attnd_bin=${ATTND:-attnd}
steps=${STEPS:-2000}
device=${DEVICE:-cuda}
prefill_transport=${PREFILL_TRANSPORT:-cuda-ipc}
context=${CONTEXT:-131072}
chunk=${CHUNK:-4096}
decode_context=${DECODE_CONTEXT:-4096}
batches=${BATCHES:-1,8,64}
kv_bytes=${KV_BYTES:-$((40 << 30))}
mkdir -p "$out"
port=$((50100 + RANDOM % 1000))
"$attnd_bin" --device "$device" --listen 127.0.0.1:$port --kv-cache-bytes "$kv_bytes" \
  --metrics-listen= "$@" >"$out/$label.attnd.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break
  sleep 0.2
done
decode() {
  data_plane_bench --target 127.0.0.1:$port --skip_prefill --transports ring,grpc \
    --decode_batches "$batches" --decode_context "$decode_context" --decode_steps "$steps" 2>&1 |
    grep -E '^decode'
}
prefill() {
  data_plane_bench --target 127.0.0.1:$port --skip_decode --transports "$prefill_transport" \
    --contexts "$context" --chunk "$chunk" "$@" 2>&1 | grep --line-buffered -E '^prefill'
}
echo "## $label ($attnd_bin $*)"
echo "# decode alone"
decode | tee "$out/$label.decode_alone.txt"
echo "# prefill alone"
prefill | tee "$out/$label.prefill_alone.txt"
echo "# decode beside a prefill stream"
# One client process prefilling prompt after prompt (no start-up gaps), stopped after the decodes.
data_plane_bench --target 127.0.0.1:$port --skip_decode --transports "$prefill_transport" \
  --contexts "$context" --chunk "$chunk" --prefill_repeat_seconds 3600 \
  >"$out/$label.prefill_busy.txt" 2>&1 &
streamer=$!
sleep 2  # the stream's first calls are in flight
decode | tee "$out/$label.decode_busy.txt"
kill "$streamer"
wait $streamer 2>/dev/null
echo "# prefill beside the decodes (each line one prompt; the last ran partly alone)"
grep -E '^prefill' "$out/$label.prefill_busy.txt"
kill "$pid"
wait "$pid" 2>/dev/null
