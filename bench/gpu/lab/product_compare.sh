#!/usr/bin/env bash
# Issue 17's before/after check from one GPU-machine call: the product's kernel figures (prefill
# 8K/32K/128K at 1 and 4 DCA chunks, decode batch 1-128 x 4K-128K and 1 x 1M, sparse 1M) from the
# binaries of the tree before the product/lab split (BEFORE_BIN: its dca_bench and sparse_bench)
# and after (lab_bench and sparse_bench on PATH), twice each, interleaved; then every gpu test.
#   BEFORE_BIN=/path/to/old/bin bench/gpu/lab/product_compare.sh OUT_DIR
# ROUNDS (default 2) sets the interleaved rounds; TESTS=none skips the tests (verify_cuda.sh runs
# them with the end-to-end smokes). bench/gpu/lab/compare.py OUT_DIR prints the before/after table.
# Before: lab_bench with the same flags when BEFORE_BIN has one (a tree after the split), else
# dca_bench --variants 5,13 --decode-variants 2,3 (the product's kernels as lab variants before the
# split: prefill 13 default, 5 fallback; decode 2 and 3). After: lab_bench's "product" rows.
set -uo pipefail
out=${1:?usage: product_compare.sh OUT_DIR}
before=${BEFORE_BIN:?BEFORE_BIN: the old binaries}
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv \
  >"$out/env.txt" 2>&1
SECONDS=0
rounds=${ROUNDS:-2}
for ((round = 1; round <= rounds; ++round)); do
  if [[ -x $before/lab_bench ]]; then
    before_cmd=("$before/lab_bench" --configs 5,13 --decode-configs 2,3)
  else
    before_cmd=("$before/dca_bench" --variants 5,13 --decode-variants 2,3)
  fi
  timeout 240 "${before_cmd[@]}" --out "$out/before_$round.txt" >/dev/null \
    2>"$out/before_$round.err" || status=1
  echo "[+${SECONDS}s] before $round"
  timeout 240 lab_bench --configs 5,13 --decode-configs 2,3 \
    --out "$out/after_$round.txt" >/dev/null 2>"$out/after_$round.err" || status=1
  echo "[+${SECONDS}s] after $round"
done
for ((round = 1; round <= rounds; ++round)); do
  timeout 100 "$before/sparse_bench" --sizes 1048576 --layers 17 --band smooth \
    --out "$out/sparse_before_$round.txt" >/dev/null 2>&1 || status=1
  timeout 100 sparse_bench --sizes 1048576 --layers 17 --band smooth \
    --out "$out/sparse_after_$round.txt" >/dev/null 2>&1 || status=1
done
echo "[+${SECONDS}s] sparse"
tests=${TESTS:-attention_tile_test dca_cuda_test lab_test rotary_cuda_test sparse_cuda_test cuda_engine_test \
golden_cuda_test sparse_golden_cuda_test sharded_engine_cuda_test}
[[ $tests == none ]] && tests=
for t in $tests; do
  if ! command -v "$t" >/dev/null; then
    echo "$t: not in the bundle"
    continue
  fi
  timeout 200 "$t" >"$out/$t.log" 2>&1
  rc=$?
  ((rc == 0)) || status=1
  echo "$t: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]|SKIPPING' "$out/$t.log" | head -10
done
echo "[+${SECONDS}s] tests"
exit $status
