#!/usr/bin/env bash
# Everything the CUDA backend needs from one GPU-machine call: correctness tests, then benchmarks
# (ours and the torch SDPA peer, in the same run). From the repo root, after building here:
#   bazel build //kernels/cuda:dca_cuda_test //server/engine:cuda_engine_test //bench/gpu/lab:lab_bench
#   script/gpu-bundle .gpu bazel-bin/kernels/cuda/dca_cuda_test \
#       bazel-bin/server/engine/cuda_engine_test bazel-bin/bench/gpu/lab/lab_bench
# then on the GPU machine:  . .gpu/env.sh && bench/gpu/run_all.sh "$OUT" [--quick|--no-peer|--prefill]
# --prefill: tests, then lab_bench --prefill-only, then the whole SDPA peer, in one call.
set -uo pipefail
out=${1:?usage: run_all.sh OUT_DIR [--quick]}
quick=${2:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,memory.total \
  --format=csv >"$out/env.txt" 2>&1
status=0
for t in dca_cuda_test cuda_engine_test; do
  if command -v "$t" >/dev/null; then
    "$t" >"$out/$t.log" 2>&1
    rc=$?
    echo "$t: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]|Failure|SKIPPING' "$out/$t.log" | head -20
    ((rc == 0)) || status=1
  else
    echo "$t: not in the bundle"
  fi
done
peer=1
if [[ $quick == --no-peer ]]; then quick=""; peer=0; fi
bench_args=$quick
if [[ $quick == --prefill ]]; then quick=""; bench_args="--prefill-only"; fi
lab_bench $bench_args --out "$out/lab_bench.txt" >/dev/null 2>"$out/lab_bench.err" || {
  echo "lab_bench failed:"; cat "$out/lab_bench.err"; status=1; }
if ((peer)); then
  PYTHONUNBUFFERED=1 python3 bench/gpu/sdpa_peer.py $quick --out "$out/sdpa_peer.txt" \
    >/dev/null 2>"$out/sdpa_peer.err" || { echo "sdpa_peer failed:"; tail -5 "$out/sdpa_peer.err"; status=1; }
fi
cat "$out/lab_bench.txt" 2>/dev/null
((peer)) && cat "$out/sdpa_peer.txt" 2>/dev/null
exit $status
