#!/usr/bin/env bash
# The Python client's decode cost next to the C++ client's, on one CUDA attnd (7B geometry, bf16,
# one layer): the per-call encoding of a decode request and decoding of its answer at batch 1, 16,
# 32, 128 (the entries form's per-entry loop against the packed form), then unary Decode at batch
# 32 and 4K context timed end to end from Python (bench/python/encode_bench.py: Client.decode, the
# bare gRPC call, the entries form) and from attnctl bench in the same run. Target
# (docs/BENCHMARKS.md): encoding <= 100 us at batch 32; Python unary decode <= 1.2x the C++ client's.
# Both clients send the same call: q [B, 3, Hq, D] (the variants a decode reads), k and v [B, Hkv, D].
# Build and bundle here:
#   bazel build //server:attnd //client:attnctl
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl
# then there, from the repository root:  . .gpu/env.sh && bench/gpu/python_decode.sh
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
port=${PORT:-50777}
batch=${BATCH:-32}
context=${CONTEXT:-4096}
attnd --device cuda --listen 127.0.0.1:$port --metrics-listen= --kv-cache-bytes 16Gi >/tmp/attnd_pydec.log 2>&1 &
pid=$!
for _ in $(seq 1 300); do attnctl info --target 127.0.0.1:$port >/dev/null 2>&1 && break; sleep 0.2; done
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  echo "== round $round"
  python3 "$here/bench/python/encode_bench.py" --target 127.0.0.1:$port --batch "$batch" \
    --context "$context" --calls 300 || status=1
  attnctl bench --target 127.0.0.1:$port --context "$context" --batch "$batch" --decode-steps 300 \
    --layers 1 --dtype bf16 --transport grpc || status=1
done
kill -TERM $pid; wait $pid
exit $status
