#!/usr/bin/env bash
# CPU backend figures through the whole serving path: attnd --device=cpu on loopback, measured with
# `attnctl bench` for the tiny model and the Qwen2.5-7B-1M geometry at a few context lengths.
#   bench/cpu/attnctl_bench.sh [OUT_DIR]      (binaries from bazel-bin/, or from PATH when bundled)
set -uo pipefail
out=${1:-/tmp/attnd-cpu-bench}
mkdir -p "$out"
attnd=$(command -v attnd || echo bazel-bin/server/attnd)
attnctl=$(command -v attnctl || echo bazel-bin/client/attnctl)
echo "# $(date -u +%FT%TZ) $(uname -n), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"

bench() {  # NAME CONFIG KV_BYTES BENCH-ARGS...
  local name=$1 config=$2 kv=$3; shift 3
  local port=$((51000 + RANDOM % 1000))
  local args=(--device cpu --listen 127.0.0.1:$port --kv-cache-bytes "$kv" --log-level warn
              --metrics-listen "")
  [[ -n $config ]] && args+=(--model-config "$config")
  "$attnd" "${args[@]}" >"$out/attnd_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do "$attnctl" info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.1; done
  echo "## $name: attnctl bench $*"
  "$attnctl" bench --target 127.0.0.1:$port "$@" 2>/dev/null | tee "$out/bench_$name.txt"
  kill -TERM $pid; wait $pid
}
bench tiny_b1 configs/tiny/config.json $((1 << 30)) --context 1024,4000 --prefill-chunk 1024 \
  --decode-steps 64 --batch 1 --layers 0 --dtype bf16
bench tiny_b8 configs/tiny/config.json $((1 << 30)) --context 1024,4000 --prefill-chunk 1024 \
  --decode-steps 64 --batch 8 --layers 0 --dtype bf16
bench 7b_b1 "" $((6 << 30)) --context 1024,4096,16384 --prefill-chunk 1024 --decode-steps 32 \
  --batch 1 --layers 1 --dtype bf16
bench 7b_b8 "" $((6 << 30)) --context 1024,4096 --prefill-chunk 1024 --decode-steps 32 \
  --batch 8 --layers 1 --dtype bf16
