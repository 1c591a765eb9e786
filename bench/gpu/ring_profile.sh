#!/usr/bin/env bash
# Where a ring decode round trip goes, on the GPU machine: attnd (7B, CUDA) serving ring decodes at
# batch 1 from data_plane_bench on the same host, with every request logged (its server-side
# latency) and `perf record -g` on attnd for part of the run. Bundle attnd, attnctl,
# data_plane_bench (bench/gpu/data_plane.sh says how) and this machine's /usr/bin/perf (the GPU
# machine has none; script/gpu-bundle brings its libraries), then there:
#   . .gpu/env.sh && bench/gpu/ring_profile.sh "$OUT" [variants|pre_rotary]
# Writes OUT/dp.txt (client p50/p99), OUT/server_latency.txt (the request log's Ring.Decode
# latencies, percentiles), OUT/perf_*.txt (perf report: self and inclusive by symbol, by thread).
set -uo pipefail
out=${1:?usage: ring_profile.sh OUT_DIR [variants|pre_rotary]}
layout=${2:-variants}
mkdir -p "$out"
start_attnd() {  # start_attnd LOG EXTRA_FLAGS...: sets pid and port
  local log=$1
  shift
  port=$((50100 + RANDOM % 1000))
  attnd --device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((40 << 30)) \
    --metrics-listen 127.0.0.1:0 "$@" >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 900); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && return; sleep 0.2; done
}
bench() {  # bench STEPS
  data_plane_bench --target 127.0.0.1:$port --transports ring --skip_prefill --decode_batches 1 \
    --decode_steps "$1" --decode_q_layout "$layout"
}
# 1. The client's figures and perf, with the default request log (one line in 1000).
start_attnd "$out/attnd.log"
bench 2000 >"$out/dp_warm.txt" 2>&1
bench 20000 >"$out/dp.txt" 2>&1
if command -v perf >/dev/null; then
  bench 100000 >"$out/dp_perf.txt" 2>&1 &
  bpid=$!
  sleep 2
  perf record -F 2999 -g -p $pid -o "$out/perf.data" -- sleep 6 >"$out/perf_record.txt" 2>&1
  wait $bpid
  # Flat lists (a call graph per line would push everything past the first few symbols).
  perf report -i "$out/perf.data" --no-children --sort sym --stdio -g none 2>/dev/null |
    head -150 >"$out/perf_self.txt"
  perf report -i "$out/perf.data" --children --sort sym --stdio -g none 2>/dev/null |
    head -250 >"$out/perf_inclusive.txt"
  perf report -i "$out/perf.data" --no-children --sort comm,dso --stdio -g none 2>/dev/null |
    head -60 >"$out/perf_threads.txt"
  rm -f "$out/perf.data"
else
  echo "no perf on this machine" >"$out/perf_symbols.txt"
fi
kill $pid
wait $pid
# 2. Every request logged (which costs the ring path some time): the server-side latencies.
start_attnd "$out/attnd_logged.log" --log-level info --request-log-sample 1 \
  --request-log-max-per-second 1000000
bench 2000 >/dev/null 2>&1
lines_before=$(wc -l <"$out/attnd_logged.log")
bench 20000 >"$out/dp_logged.txt" 2>&1
tail -n +"$((lines_before + 1))" "$out/attnd_logged.log" | grep 'method=Ring.Decode' |
  sed -E 's/.*latency_us=([0-9]+).*/\1/' | sort -n >"$out/ring_latency_us.txt"
python3 - "$out/ring_latency_us.txt" >"$out/server_latency.txt" <<'PY'
import sys
v = [int(x) for x in open(sys.argv[1]) if x.strip()]
if v:
    q = lambda p: v[min(len(v) - 1, int(p * len(v)))]
    print(f"Ring.Decode server-side latency_us over {len(v)} requests: p10 {q(.1)} p50 {q(.5)} "
          f"p90 {q(.9)} p99 {q(.99)}")
PY
kill $pid
wait $pid
