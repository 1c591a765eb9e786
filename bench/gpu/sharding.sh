#!/usr/bin/env bash
# kv-head sharding (#21) on one GPU, in one call: the CUDA tests (the engine's own, the sharded
# engine against the unsharded one with both shards on this GPU, the golden cases unsharded and
# with --devices 0,0 over every transport), then the sharded engine's overhead in-process
# (bench/sharding/sharding_bench.cc: 7B and 14B geometry, prefill dense and sparse, decode batch
# 1-64 at 4K and 32 x 128K), then the daemon with --devices 0,0 against one without: attnctl
# smoke and the serving path per transport. Build and bundle here:
#   bazel build //server:attnd //client:attnctl //bench/data_plane:data_plane_bench \
#     //bench/sharding:sharding_bench //server/engine:cuda_engine_test //server/engine:sharded_engine_cuda_test \
#     //tests:golden_cuda_test //tests:sparse_golden_cuda_test
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#     bazel-bin/bench/data_plane/data_plane_bench bazel-bin/bench/sharding/sharding_bench \
#     bazel-bin/server/engine/cuda_engine_test bazel-bin/server/engine/sharded_engine_cuda_test \
#     bazel-bin/tests/golden_cuda_test bazel-bin/tests/sparse_golden_cuda_test
# then there:  . .gpu/env.sh && bench/gpu/sharding.sh "$OUT" [tests|engine|serving ...]
set -uo pipefail
out=${1:?usage: sharding.sh OUT_DIR [tests] [engine] [serving]}
shift
parts=${*:-tests engine serving}
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"

if [[ $parts == *tests* ]]; then
  for t in sharded_engine_cuda_test cuda_engine_test golden_cuda_test sparse_golden_cuda_test; do
    "$t" >"$out/$t.log" 2>&1
    rc=$?
    ((rc == 0)) || status=1
    echo "$t: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]|Failure|error' "$out/$t.log" | head -20
  done
fi

if [[ $parts == *engine* ]]; then
  echo "## in-process: --devices 0 against --devices 0,0"
  q7=configs/qwen2.5-7b-instruct-1m/config.json
  q14=configs/qwen2.5-14b-instruct-1m/config.json
  sharding_bench --model_config $q7 --inputs device --contexts 32768,131072 --decode_batches "" |
    tee "$out/engine_7b_prefill_device.txt"
  sharding_bench --model_config $q7 --inputs host --contexts 32768,131072 \
    --decode_batches 1,8,32,64 | tee "$out/engine_7b_host.txt"
  sharding_bench --model_config $q14 --inputs device --contexts 32768,131072 \
    --decode_batches 1,8,32,64 | tee "$out/engine_14b.txt"
  sharding_bench --model_config $q7 --contexts "" --decode_context 131072 --decode_batches 32 \
    --decode_steps 100 | tee "$out/engine_7b_decode_32x128k.txt"
fi

if [[ $parts == *serving* ]]; then
  for devices in 0 0,0; do
    tag=${devices/,/_}
    port=$((50100 + RANDOM % 1000))
    attnd --device cuda --devices $devices --listen 127.0.0.1:$port --kv-cache-bytes $((40 << 30)) \
      --metrics-listen 127.0.0.1:0 >"$out/attnd_$tag.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
    echo "## daemon --devices $devices"
    attnctl info --target 127.0.0.1:$port | grep -E "^(device|pages|pool bytes|shard)"
    timeout 150 attnctl smoke --target 127.0.0.1:$port --q-layout pre_rotary --dtype bf16 \
      --max-tokens 20000 >"$out/smoke_$tag.log" 2>&1 || status=1
    echo "smoke pre_rotary (7B, 20000 tokens): $(tail -1 "$out/smoke_$tag.log")"
    data_plane_bench --target 127.0.0.1:$port --contexts 32768 --transports grpc,cuda-ipc,ring \
      --decode_batches 1,8,64 2>&1 | tee "$out/serving_$tag.txt"
    ((PIPESTATUS[0] == 0)) || status=1
    kill "$pid"
    wait "$pid" 2>/dev/null
  done
fi
exit $status
