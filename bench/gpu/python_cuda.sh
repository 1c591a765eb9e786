#!/usr/bin/env bash
# The Python client on the GPU machine, with that machine's own torch and grpcio: every Python test that
# needs CUDA (torch CUDA tensors registered by CUDA IPC with attnd --device cuda: the handle that torch
# gives, the golden case's prefills and decodes through CUDA regions against the golden bars, the
# expandable-segment refusal), then the whole Python suite against CPU daemons (torch-version drift).
# CUDA tests must run here: no CUDA device for torch is a failure, not a skip. Build and bundle here:
#   bazel build //server:attnd
#   script/gpu-bundle .gpu bazel-bin/server/attnd   (also writes the Python stubs: .gpu/python)
# then there, from the repository root:  . .gpu/env.sh && bench/gpu/python_cuda.sh [OUT_DIR]
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$(mktemp -d)}
mkdir -p "$out"
py=${PYTHON:-python3}
: "${ATTND_PYTHON_STUBS:?source the bundle env.sh first (. .gpu/env.sh), which names the Python stubs}"
ATTND_BIN=$(command -v attnd) || { echo "python_cuda: no attnd on PATH (. .gpu/env.sh)" >&2; exit 1; }
export ATTND_BIN
cd "$here"

"$py" - <<'PY' || exit 1
import sys
import google.protobuf, grpc, numpy, torch
print("python %s | torch %s (CUDA %s) | grpcio %s | protobuf %s | numpy %s" % (
    sys.version.split()[0], torch.__version__, torch.version.cuda, grpc.__version__,
    google.protobuf.__version__, numpy.__version__))
if not torch.cuda.is_available():
    sys.exit("python_cuda: torch sees no CUDA device: the CUDA tests cannot run")
print("device:", torch.cuda.get_device_name(), "| _share_cuda_ handle:",
      len(torch.zeros(1, device="cuda").untyped_storage()._share_cuda_()[1]), "bytes")
PY

status=0
run() {  # NAME UNITTEST-ARGS...
  local name=$1; shift
  "$py" -m unittest "$@" >"$out/$name.log" 2>&1
  local rc=$?
  ((rc == 0)) || status=1
  local summary
  summary=$(grep -E '^Ran |^OK|^FAILED' "$out/$name.log" | tr '\n' ' ')
  echo "$name: exit $rc; $summary"
  grep -E '^\[CudaRegionTorch\]|^(FAIL|ERROR):|skipped ' "$out/$name.log" | head -20
}
# -v lists each test with its result; a skipped CUDA test is a failure of this lane.
run python_cuda_tests -v tests.python.test_regions.CudaRegionTorch tests.python.test_regions.TorchCudaHandles
if grep -q "skipped" "$out/python_cuda_tests.log"; then
  echo "python_cuda: a CUDA test skipped (see $out/python_cuda_tests.log)"
  status=1
fi
run python_all discover -s tests/python -t .
exit $status
