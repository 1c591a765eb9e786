#!/usr/bin/env bash
# The ring's decode round trip at batch 1 (7B, 4K context, variants and pre-rotary q) under attnd
# flag variants that could move it: default, no cross-call batcher, no queue delay, a longer ring
# spin, no CUDA graphs, one batch in flight. Two interleaved rounds, a fresh daemon per variant.
# Bundle attnd, attnctl and data_plane_bench (bench/gpu/data_plane.sh says how), then there:
#   bench/gpu/ring_sweep.sh OUT_DIR      (sources .gpu/env.sh itself; one line per variant/layout)
# With ATTND_BEFORE=/path/to/attnd it compares that binary ("before") with the attnd on PATH
# ("after") instead, default flags, three interleaved rounds, batch 1 and 8.
set -uo pipefail
out=${1:?usage: ring_sweep.sh OUT_DIR}
mkdir -p "$out"
. .gpu/env.sh
batches=1
attnd_bin=attnd
run() {  # name flags...
  local name=$1; shift
  port=$((50100 + RANDOM % 1000))
  "$attnd_bin" --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((40 << 30)) --metrics-listen 127.0.0.1:0 "$@" > $out/attnd_$name.log 2>&1 &
  pid=$!
  for _ in $(seq 1 900); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
  for lay in variants pre_rotary; do
    data_plane_bench --target 127.0.0.1:$port --transports ring --skip_prefill --decode_batches $batches --decode_steps 2000 --decode_q_layout $lay >/dev/null 2>&1
    data_plane_bench --target 127.0.0.1:$port --transports ring --skip_prefill --decode_batches $batches --decode_steps 20000 --decode_q_layout $lay 2>&1 | grep ring | sed "s/^/$name\t/"
  done
  kill $pid; wait $pid
}
if [[ -n ${ATTND_BEFORE:-} ]]; then
  batches=1,8
  for r in 1 2 3; do
    attnd_bin=$ATTND_BEFORE
    run before
    attnd_bin=attnd
    run after
  done
  exit 0
fi
for r in 1 2; do
  run default
  run nobatcher --decode_batching=false
  run nodelay --max_queue_delay_us=0
  run spin500 --ring_spin_us=500
  run nographs --disable_cuda_graphs
  run oneinflight --decode_batches_in_flight=1
done
