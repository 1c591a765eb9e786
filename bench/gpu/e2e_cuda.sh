#!/usr/bin/env bash
# End to end on the GPU machine: attnd --device=cuda serves the golden case over gRPC and passes
# `attnctl smoke` (tiny model; 7B geometry with small DCA chunks so a smoke spans 3 chunks; the
# default 7B config within a token cap), and `attnctl bench` gives serving-path numbers.
# Build and bundle here:
#   bazel build //server:attnd //client:attnctl //tests:golden_cuda_test
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#       bazel-bin/tests/golden_cuda_test
# then there:  . .gpu/env.sh && bench/gpu/e2e_cuda.sh "$OUT"
set -uo pipefail
out=${1:?usage: e2e_cuda.sh OUT_DIR}
mkdir -p "$out"
status=0

golden_cuda_test >"$out/golden_cuda_test.log" 2>&1
rc=$?; ((rc == 0)) || status=1
echo "golden_cuda_test: exit $rc; $(grep -E 'max abs|PASSED|FAILED|SKIPPED' "$out/golden_cuda_test.log" | tail -6 | tr '\n' ' ')"

# 7B geometry (28 q / 4 kv heads, head_dim 128) with chunk_len 2048, so 5120 tokens span 3 chunks.
small=$(mktemp -d)
cat >"$small/config.json" <<'JSON'
{"_name_or_path": "qwen2.5-7b-geometry-chunk2k", "num_hidden_layers": 28, "num_attention_heads": 28,
 "num_key_value_heads": 4, "hidden_size": 3584, "max_position_embeddings": 1010000,
 "dual_chunk_attention_config": {"chunk_size": 2560, "local_size": 512,
                                 "original_max_position_embeddings": 2048}}
JSON

serve_and_smoke() {  # NAME CONFIG SMOKE-ARGS...
  local name=$1 config=$2; shift 2
  local port=$((50100 + RANDOM % 1000))
  local args=(--device cuda --listen 127.0.0.1:$port --kv-cache-bytes $((16 << 30)) --metrics-listen 127.0.0.1:0)
  [[ -n $config ]] && args+=(--model-config "$config")
  attnd "${args[@]}" >"$out/attnd_$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
  attnctl smoke --target 127.0.0.1:$port "$@" >"$out/smoke_$name.log" 2>&1
  local rc=$?
  ((rc == 0)) || status=1
  echo "smoke $name ($*): exit $rc; $(grep -E '^(spans|PASS|FAIL|NOTE)' "$out/smoke_$name.log" | tr '\n' ' ')"
  if [[ $name == 7b_chunk2k ]]; then
    attnctl bench --target 127.0.0.1:$port --context 4096,16384 --prefill-chunk 4096 \
      --decode-steps 32 --batch 8 --layers 1 --dtype bf16 >"$out/bench_$name.txt" 2>&1
    cat "$out/bench_$name.txt"
  fi
  kill -TERM $pid; wait $pid; echo "attnd $name exit after SIGTERM: $?"
}
serve_and_smoke tiny_fp32 configs/tiny/config.json --dtype fp32
serve_and_smoke tiny_bf16 configs/tiny/config.json --dtype bf16
serve_and_smoke 7b_chunk2k "$small/config.json" --dtype bf16 --max-tokens 5120 --layers 2
serve_and_smoke 7b_default "" --dtype bf16 --max-tokens 8192 --layers 1
exit $status
