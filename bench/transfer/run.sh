#!/usr/bin/env bash
# The gRPC bytes path of large Prefill calls (issue #15, item 2): starts attnd and runs
# transfer_bench against it on loopback, 7B geometry (the default model), bf16, 4096 tokens, both q
# layouts (q [T,5,28,128]: 155 MB requests; pre-rotary q [T,28,128]: 38 MB).
#
#   bench/transfer/run.sh OUT_DIR [DEVICE]      DEVICE: cpu (default) or cuda
#
# Binaries come from PATH when bundled (script/gpu-bundle DIR bazel-bin/server/attnd
# bazel-bin/bench/transfer/transfer_bench bazel-bin/client/attnctl; then `. DIR/env.sh`), else from
# bazel-bin/ (bazel build //server:attnd //bench/transfer:transfer_bench //client:attnctl).
# Cases: upload (received, parsed, rejected before compute) with the pre-serialized (raw) and the
# per-call protobuf (proto) client; prefill (the real call) with the raw client: on cuda at 4096
# tokens, on cpu at 256 tokens (the CPU kernels take seconds at 4096). Extra arguments for attnd
# can be passed in ATTND_ARGS, for transfer_bench in BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: bench/transfer/run.sh OUT_DIR [cpu|cuda]}
device=${2:-cpu}
mkdir -p "$out"
attnd=$(command -v attnd || echo bazel-bin/server/attnd)
bench=$(command -v transfer_bench || echo bazel-bin/bench/transfer/transfer_bench)
port=$((52000 + RANDOM % 1000))
{
  echo "# $(date -u +%FT%TZ) $(uname -n), $(nproc) cores,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "# git $(git rev-parse --short HEAD 2>/dev/null || echo '?') device=$device ATTND_ARGS=${ATTND_ARGS:-} BENCH_ARGS=${BENCH_ARGS:-}"
} | tee "$out/transfer.txt"
kv=$((2 << 30))
# shellcheck disable=SC2086
"$attnd" --device "$device" --listen 127.0.0.1:$port --kv-cache-bytes $kv --log-level warn \
  --metrics-listen "" ${ATTND_ARGS:-} >"$out/attnd.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do
  "$bench" --target 127.0.0.1:$port --tokens 1 --modes "" >/dev/null 2>&1 && break
  sleep 0.2
done
prefill_tokens=256
[[ $device == cuda ]] && prefill_tokens=4096
run() {
  # shellcheck disable=SC2086
  "$bench" --target 127.0.0.1:$port "$@" ${BENCH_ARGS:-} 2>&1 | tee -a "$out/transfer.txt"
}
run --tokens 4096 --modes upload --client raw --repeat 10
run --tokens 4096 --modes upload --client proto --repeat 10
run --tokens $prefill_tokens --modes prefill --client raw --repeat 10
run --tokens $prefill_tokens --modes prefill --client proto --repeat 10
kill -TERM $pid
wait $pid
echo "# attnd exited $?" | tee -a "$out/transfer.txt"
