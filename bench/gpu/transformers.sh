#!/usr/bin/env bash
# transformers' Qwen2 with its attention in attnd, on the GPU machine (docs/transformers.md; results in
# docs/BENCHMARKS.md, "transformers"): the adapter's CPU tests against that machine's transformers and torch,
# the example's path (examples/python/hf_generate.py, random weights), then bench/python/hf_bench.py: tokens
# identical to sdpa in fp32, bf16 logits with forced tokens, hidden states over 4 DCA chunks against
# plain-torch DCA, decode tokens/s next to sdpa, profiles; `--parts million` runs the 1M-token prompt on all 28
# layers instead (about 74 GiB of device memory between the two processes). Build and bundle here:
#   bazel build //server:attnd
#   script/gpu-bundle .gpu bazel-bin/server/attnd   (also writes the Python stubs: .gpu/python)
# then there, from the repository root:  . .gpu/env.sh && bench/gpu/transformers.sh OUT_DIR [hf_bench args]
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?usage: transformers.sh OUT_DIR [hf_bench.py args]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
: "${ATTND_PYTHON_STUBS:?source the bundle env.sh first (. .gpu/env.sh)}"
ATTND_BIN=$(command -v attnd) || { echo "transformers.sh: no attnd on PATH" >&2; exit 1; }
export ATTND_BIN PYTHONPATH="$ATTND_PYTHON_STUBS${PYTHONPATH:+:$PYTHONPATH}"
cd "$here"
status=0
"$py" -m unittest tests.python.test_transformers_adapter >"$out/adapter_tests.log" 2>&1 || status=1
echo "adapter tests: $(grep -E '^Ran |^OK|^FAILED' "$out/adapter_tests.log" | tr '\n' ' ')"

port=$((50100 + RANDOM % 1000))
attnd --device cuda --listen 127.0.0.1:$port --metrics-listen= --kv-cache-bytes 8Gi \
  --model-config configs/qwen2.5-7b-instruct-1m/config.json >"$out/example_attnd.log" 2>&1 &
pid=$!
"$py" examples/python/hf_generate.py --config configs/qwen2.5-7b-instruct-1m/config.json --layers 2 \
  --target 127.0.0.1:$port --prompt-tokens 4096 --max-new-tokens 16 >"$out/example.txt" 2>&1 || status=1
echo "example: $(tail -2 "$out/example.txt" | tr '\n' ' ')"
kill $pid
wait $pid 2>/dev/null

"$py" bench/python/hf_bench.py --attnd "$ATTND_BIN" "$@" 2>"$out/hf_bench.err" | tee "$out/hf_bench.txt"
((PIPESTATUS[0] == 0)) || status=1
exit $status
