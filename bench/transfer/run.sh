#!/usr/bin/env bash
# The gRPC bytes path of large Prefill calls (issue #15, item 2): starts attnd in three
# configurations and runs transfer_bench against each on loopback; 7B geometry (the default
# model), bf16, 4096 tokens, both q layouts (q [T,5,28,128]: 155 MB requests; pre-rotary
# q [T,28,128]: 38 MB). Then the Python client (examples/python/transfer_bench.py) if python3 has
# grpc and numpy ($PYTHON, python3 or /usr/bin/python3; plain and with glibc's mmap off), and on cuda `attnctl bench` at 4096 tokens.
#
#   bench/transfer/run.sh OUT_DIR [DEVICE]      DEVICE: cpu (default) or cuda
#
# Binaries come from PATH when bundled (script/gpu-bundle DIR bazel-bin/server/attnd
# bazel-bin/bench/transfer/transfer_bench bazel-bin/client/attnctl; then `. DIR/env.sh`), else from
# bazel-bin/ (bazel build //server:attnd //bench/transfer:transfer_bench //client:attnctl).
#
# Configurations: "before" (attnd --wire-fast-path=false: protobuf parses and serializes, as
# before issue #15), "after" (the defaults), "after+h2" (the defaults plus a 64 MiB HTTP/2 stream
# window and 16 MiB frames on both sides). Modes: upload (received, parsed, rejected before any
# compute: the wire and the parse) and prefill (the real call; on cuda at 4096 tokens, on cpu at
# 256 tokens because the CPU kernels take seconds at 4096). Clients: raw (request serialized
# before the clock starts: the transport and the server only), lib (AttndClient::Prefill, the C++
# client library: what attnctl does), lib_proto (the same through the protobuf classes, as
# before issue #15), proto (protobuf build + serialize per call). Extra arguments: ATTND_ARGS for
# attnd, BENCH_ARGS for transfer_bench (e.g. BENCH_ARGS="--repeat 20").
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/transfer/run.sh OUT_DIR [cpu|cuda]}
device=${2:-cpu}
mkdir -p "$out"
attnd=$(command -v attnd || echo bazel-bin/server/attnd)
bench=$(command -v transfer_bench || echo bazel-bin/bench/transfer/transfer_bench)
attnctl=$(command -v attnctl || echo bazel-bin/client/attnctl)
log=$out/transfer.txt
{
  echo "# $(date -u +%FT%TZ) $(uname -n), $(nproc) cores,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "# git $(git rev-parse --short HEAD 2>/dev/null || echo '?') device=$device ATTND_ARGS=${ATTND_ARGS:-} BENCH_ARGS=${BENCH_ARGS:-}"
} | tee "$log"
prefill_tokens=256
[[ $device == cuda ]] && prefill_tokens=4096
H2_SERVER="grpc.http2.lookahead_bytes=67108864,grpc.http2.max_frame_size=16777215"
H2_CLIENT="--lookahead_bytes 67108864 --max_frame_size 16777215"

start() {  # NAME ATTND-ARGS...: starts attnd, sets $port and $pid
  local name=$1; shift
  port=$((52000 + RANDOM % 1000))
  # shellcheck disable=SC2086
  "$attnd" --device "$device" --listen 127.0.0.1:$port --kv-cache-bytes $((4 << 30)) \
    --log-level warn --metrics-listen "" "$@" ${ATTND_ARGS:-} >"$out/attnd_$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    "$bench" --target 127.0.0.1:$port --tokens 1 --modes "" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "attnd ($name) did not come up; see $out/attnd_$name.log" | tee -a "$log"
  return 1
}
stop() {
  kill -TERM "$pid"
  wait "$pid"
  echo "# attnd exited $?" | tee -a "$log"
}
run() {  # LABEL BENCH-ARGS...
  local label=$1; shift
  # shellcheck disable=SC2086
  "$bench" --target 127.0.0.1:$port --label "$label" "$@" ${BENCH_ARGS:-} 2>&1 | grep -v '^#' |
    tee -a "$log"
}
cases() {  # LABEL EXTRA-BENCH-ARGS...
  local label=$1; shift
  for client in raw lib lib_proto proto; do
    run "$label,$client" --tokens 4096 --modes upload --client $client --repeat 10 "$@"
  done
  for client in raw lib lib_proto; do
    run "$label,$client" --tokens $prefill_tokens --modes prefill --client $client --repeat 10 "$@"
  done
}

echo "## before: attnd --wire-fast-path=false" | tee -a "$log"
start before --wire-fast-path=false && { cases before; stop; }
echo "## after: attnd defaults" | tee -a "$log"
if start after; then
  cases after
  py=""
  for candidate in ${PYTHON:-} python3 /usr/bin/python3; do
    if "$candidate" -c 'import grpc, numpy' 2>/dev/null; then py=$candidate; break; fi
  done
  if [[ -n $py ]]; then
    for env in "" "MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=268435456"; do
      echo "## python client, env [$env]: examples/python/transfer_bench.py --tokens 4096" | tee -a "$log"
      # shellcheck disable=SC2086
      env $env "$py" examples/python/transfer_bench.py --target 127.0.0.1:$port --tokens 4096 \
        --repeat 5 2>&1 | tee -a "$log"
    done
  else
    echo "## python client skipped: no python3 with grpc and numpy (set PYTHON)" | tee -a "$log"
  fi
  if [[ $device == cuda ]]; then
    echo "## attnctl bench --context 4096 --prefill-chunk 4096 (default model, 1 layer, bf16)" | tee -a "$log"
    "$attnctl" bench --target 127.0.0.1:$port --context 4096 --prefill-chunk 4096 \
      --decode-steps 8 --batch 1 --layers 1 --dtype bf16 2>&1 | tee -a "$log"
  fi
  stop
fi
echo "## after+h2: attnd defaults + --grpc-channel-args $H2_SERVER, clients $H2_CLIENT" | tee -a "$log"
# shellcheck disable=SC2086
start after_h2 --grpc-channel-args "$H2_SERVER" && { cases after+h2 $H2_CLIENT; stop; }
