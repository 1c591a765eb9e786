#!/usr/bin/env bash
# The step scheduler on the H200 (docs/scheduling.md), in one call: the CUDA tests of stepped
# prefill (key-tile windows bit for bit, the engine's stepped prefill, device decode rows) and the
# golden cases, the cost of key-tile windows (prefill_window.sh, with WINDOWS=1), then decode
# beside a 128K prefill stream (decode_under_prefill.sh) for attnd's default, for 8192-key steps,
# for whole-call steps (--prefill-step-keys 1000000000: the two lanes and stream priorities
# alone), and, with ATTND_BEFORE=path, an older attnd. Build and bundle here:
#   bazel build //server:attnd //client:attnctl //bench/data_plane:data_plane_bench \
#     //kernels/cuda:dca_cuda_test //server/engine:cuda_engine_test //bench/gpu:prefill_window_bench \
#     //tests:golden_cuda_test //tests:sparse_golden_cuda_test //server/engine:cuda_engine_sparse_test
#   script/gpu-bundle .gpu bazel-bin/server/attnd bazel-bin/client/attnctl \
#     bazel-bin/bench/data_plane/data_plane_bench bazel-bin/kernels/cuda/dca_cuda_test \
#     bazel-bin/server/engine/cuda_engine_test bazel-bin/bench/gpu/prefill_window_bench \
#     bazel-bin/tests/golden_cuda_test bazel-bin/tests/sparse_golden_cuda_test \
#     bazel-bin/server/engine/cuda_engine_sparse_test
# then there:  . .gpu/env.sh && [ATTND_BEFORE=old/attnd] [WINDOWS=1] bench/gpu/scheduling.sh "$OUT"
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: scheduling.sh OUT_DIR}
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
for t in cuda_engine_test golden_cuda_test sparse_golden_cuda_test cuda_engine_sparse_test \
  dca_cuda_test; do
  "$t" >"$out/$t.log" 2>&1 || status=1
  echo "$t: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$out/$t.log" | head -20
done
if [[ -n ${WINDOWS:-} ]]; then "$here/prefill_window.sh" "$out/windows" || status=1; fi
LABEL=default "$here/decode_under_prefill.sh" "$out"
LABEL=keys8192 "$here/decode_under_prefill.sh" "$out" --prefill-step-keys 8192
LABEL=whole_calls "$here/decode_under_prefill.sh" "$out" --prefill-step-keys 1000000000
if [[ -n ${ATTND_BEFORE:-} ]]; then
  LABEL=before ATTND=$ATTND_BEFORE "$here/decode_under_prefill.sh" "$out"
fi
exit $status
