#!/usr/bin/env bash
# Where one engine decode step's time goes (Engine::Decode, 7B geometry, bf16 KV, one layer, 4K
# context, graph replay): the step with the inputs in host memory (what gRPC bytes, shm regions and
# inline ring frames hand the engine: copied into pinned slots, read across PCIe, outputs copied
# back) against the same step with q, k, v and the outputs already in device memory (what CUDA IPC
# regions hand it: the kernels alone), variants and pre-rotary q; then each kernel's device time in
# the device-input step under ncu. With BEFORE=path/to/an/older/decode_step_bench the pre-rotary
# runs alternate the two builds (a change's before/after in one call). Build and bundle here:
#   bazel build //bench/gpu:decode_step_bench
#   script/gpu-bundle .gpu bazel-bin/bench/gpu/decode_step_bench
# then there:  . .gpu/env.sh && [BEFORE=...] bench/gpu/step_composition.sh OUT_DIR
# About 3 minutes on an H100 (each run prefills its sequences twice: graph and eager engines).
set -uo pipefail
out=${1:?usage: step_composition.sh OUT_DIR}
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
status=0
batches=${BATCHES:-1,8,64,128}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"

run() {  # run NAME BINARY INPUTS LAYOUT
  echo "## $1: --inputs $3 --q_layout $4"
  timeout 150 "$2" --context 4096 --batches "$batches" --iters 200 --capture_layers 0 \
    --inputs "$3" --q_layout "$4" >"$out/$1.txt" 2>&1 || status=1
  grep -A5 "^summary" "$out/$1.txt"
}
run host_variants decode_step_bench host variants
for inputs in host device; do
  [[ -n ${BEFORE:-} ]] && run "before_${inputs}_pre_rotary" "$BEFORE" "$inputs" pre_rotary
  run "${inputs}_pre_rotary" decode_step_bench "$inputs" pre_rotary
done

ncu=$(command -v ncu || find /opt/nvidia/nsight-compute -maxdepth 2 -name ncu -type f 2>/dev/null | head -1)
if [[ -z $ncu ]]; then
  echo "ncu: not found; per-kernel times skipped"
  exit $status
fi
for b in ${NCU_BATCHES:-1 64}; do
  echo "## kernels of the device-input pre-rotary step at batch $b (ncu, median device time)"
  # No cache flush before each kernel: a flush inflates small kernels by a few microseconds.
  timeout 150 "$ncu" --clock-control none --cache-control none --graph-profiling node \
    -k regex:Decode --metrics gpu__time_duration.sum --csv decode_step_bench --context 4096 --batches "$b" \
    --iters 4 --capture_layers 0 --inputs device --q_layout pre_rotary \
    >"$out/ncu_b$b.csv" 2>"$out/ncu_b$b.err" || status=1
  python3 "$here/bench/gpu/ncu_kernels.py" "$out/ncu_b$b.csv" || status=1
done
exit $status
