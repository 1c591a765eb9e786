#!/usr/bin/env bash
# The wgmma prefill variants in one GPU-machine call (< 120 s of GPU time): the prefill tests of
# lab_test (every variant, every case), a SASS summary of the wgmma kernels, lab_bench
# --prefill-only for the chosen variants, torch SDPA (cuDNN, flash) on the same shapes, and, where
# ncu can read counters, a short warp-state profile of two variants at 8K. A table goes to stdout;
# OUT_DIR gets two files: prefill_summary.txt (the table) and prefill_logs.tgz (everything).
# Build and bundle here (only these two programs are needed):
#   bazel build //bench/gpu/lab:lab_test //bench/gpu/lab:lab_bench
#   script/gpu-bundle .gpu-p bazel-bin/bench/gpu/lab/lab_test \
#       bazel-bin/bench/gpu/lab/lab_bench
# then there (carry .gpu-p):
#   . .gpu-p/env.sh && bench/gpu/lab/prefill_variants.sh "$OUT/prefill" [VARIANTS] [NCU_VARIANTS]
# VARIANTS defaults to 5,9,11,12,13,14 (lab_bench always times the mma.sync fallback 5 too);
# NCU_VARIANTS defaults to 9,11; "none" skips ncu.
set -uo pipefail
out=${1:?usage: prefill_variants.sh OUT_DIR [VARIANTS] [NCU_VARIANTS]}
variants=${2:-5,9,11,12,13,14}
ncu_variants=${3:-9,11}
here=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out"
logs=$(mktemp -d)
status=0
t0=$SECONDS
step() { echo "[prefill_variants +$((SECONDS - t0))s] $*" >&2; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
  --format=csv >"$logs/env.txt" 2>&1

# 1. Correctness: every prefill case, every variant (NaN-poisoned outputs, fp64 and simple-kernel
#    bars). ~30 s.
step "lab_test prefill"
timeout 240 lab_test --gtest_filter='Shapes/PrefillTest.*' >"$logs/dca_cuda_test_prefill.log" 2>&1
rc=$?
((rc == 0)) || status=1
test_line="lab_test prefill: exit $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' \
  "$logs/dca_cuda_test_prefill.log" | tr '\n' ' ')"

# 2. SASS of the wgmma kernels (no device time): opcode counts per kernel, full listing kept.
step "cuobjdump"
if command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$(command -v lab_bench)" >"$logs/lab_bench.sass" 2>&1 || true
  python3 - "$logs/lab_bench.sass" >"$logs/sass_summary.txt" 2>&1 <<'PY' || true
import collections, re, sys
kern, counts, order = None, {}, []
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"Function : (\S+)", line)
    if m:
        kern = m.group(1)
        counts[kern] = collections.Counter()
        order.append(kern)
        continue
    m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
    if m and kern:
        counts[kern][m.group(2)] += 1
        counts[kern]["total"] += 1
want = ["total", "HGMMA", "WARPGROUP", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "SHFL",
        "LDGSTS", "LDG", "LDL", "STL", "SYNCS", "BAR", "IMAD", "LEA", "SEL", "BRA", "MOV"]
print("kernel " + " ".join(want))
for k in order:
    if "Wgmma" not in k:
        continue
    short = re.sub(r"^_ZN5attnd12cuda_kernels5wgmma21DcaPrefillWgmmaKernel", "", k)
    print(short + " " + " ".join(f"{w}={counts[k][w]}" for w in want))
PY
else
  echo "no cuobjdump on this machine" >"$logs/sass_summary.txt"
fi

# 3. Our kernels. ~25 s for five variants.
step "lab_bench --prefill-only --configs $variants"
timeout 200 lab_bench --prefill-only --configs "$variants" --out "$logs/lab_bench.txt" \
  >/dev/null 2>"$logs/lab_bench.err" || { echo "lab_bench failed:"; tail -5 "$logs/lab_bench.err"; status=1; }

# 4. torch SDPA on the same shapes in the same call (cuDNN and flash; the memory-efficient backend
#    is far behind and slow at 128K). ~30 s with the torch import.
step "sdpa_peer"
PYTHONUNBUFFERED=1 timeout 150 python3 "$here/bench/gpu/sdpa_peer.py" --prefill-only \
  --backends cudnn,flash --out "$logs/sdpa_peer.txt" >/dev/null 2>"$logs/sdpa_peer.err" ||
  { echo "sdpa_peer failed:"; tail -5 "$logs/sdpa_peer.err"; status=1; }

# 5. Warp-state profile at 8K (Firecracker machines only; gVisor's ncu cannot read counters):
#    one launch per variant, the first DcaPrefillWgmmaKernel launch after the mma.sync baseline.
if [[ $ncu_variants != none ]] && command -v ncu >/dev/null; then
  IFS=, read -ra nv <<<"$ncu_variants"
  for v in "${nv[@]}"; do
    step "ncu variant $v"
    timeout 40 ncu --clock-control none -k regex:DcaPrefillWgmmaKernel --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section LaunchStats --section SourceCounters \
      lab_bench --quick --prefill-only --configs "$v" >"$logs/ncu_v$v.txt" 2>&1 ||
      echo "ncu variant $v: exit $? (see ncu_v$v.txt)" >>"$logs/ncu_v$v.txt"
  done
fi
step "done"

# Table: TFLOP/s per variant and L, and each over the best SDPA backend at that L.
python3 - "$logs/lab_bench.txt" "$logs/sdpa_peer.txt" >"$logs/table.txt" 2>&1 <<'PY'
import collections, sys
ours = collections.OrderedDict()  # (L, cl) -> {variant: (tflops, max_diff)}
labels = []
try:
    for line in open(sys.argv[1]):
        f = line.split()
        if len(f) == 8 and f[0].isdigit():
            key = (int(f[0]), int(f[1]))
            ours.setdefault(key, {})[f[3]] = (float(f[5]), f[6])
            if f[3] not in labels:
                labels.append(f[3])
except OSError:
    pass
sdpa = collections.defaultdict(dict)  # L -> {backend: tflops}
try:
    for line in open(sys.argv[2]):
        f = line.split()
        if len(f) == 5 and f[0].isdigit():
            sdpa[int(f[0])][f[1]] = float(f[4])
except OSError:
    pass
print("TFLOP/s (causal-equivalent); x = over the best torch SDPA backend at that L; "
      "d = max |diff| vs the mma.sync fallback (last 8K tokens)")
print(f"{'L':<7} {'chunk':<7}" + "".join(f" {l:>22}" for l in labels) + "   cudnn   flash")
for (L, cl), row in ours.items():
    best = max(sdpa.get(L, {}).values(), default=0.0)
    cells = []
    for l in labels:
        if l in row:
            t, d = row[l]
            x = f"{t / best:.2f}x" if best else "-"
            cells.append(f"{t:7.1f} {x:>6} d={d:<6}")
        else:
            cells.append("-")
    peer = sdpa.get(L, {})
    print(f"{L:<7} {cl:<7}" + "".join(f" {c:>22}" for c in cells) +
          f" {peer.get('cudnn', 0):7.1f} {peer.get('flash', 0):7.1f}")
PY

{
  echo "$test_line"
  grep -E '^\[  FAILED  \]|Failure|SKIPPING' "$logs/dca_cuda_test_prefill.log" | head -20
  # Worst error per variant label over all prefill cases (vs fp64 and vs the simple kernel).
  python3 - "$logs/dca_cuda_test_prefill.log" <<'PY' || true
import re, sys
worst = {}
for line in open(sys.argv[1], errors="replace"):
    m = re.match(r"\s+\S+ (.+?) (vs simple )?\[\d+,\d+\)\s+n=\d+ max_abs=(\S+) mean_abs=(\S+)", line)
    if m:
        key = (m.group(1), "vs simple" if m.group(2) else "vs fp64")
        mx, mean = float(m.group(3)), float(m.group(4))
        a = worst.get(key, (0.0, 0.0))
        worst[key] = (max(a[0], mx), max(a[1], mean))
for label in sorted({k[0] for k in worst}):
    cells = [f"{ref} max {worst[(label, ref)][0]:.4g} mean {worst[(label, ref)][1]:.3g}"
             for ref in ("vs fp64", "vs simple") if (label, ref) in worst]
    print(f"  worst {label:<34} " + " | ".join(cells))
PY
  echo
  cat "$logs/table.txt"
  echo
  cat "$logs/sass_summary.txt" 2>/dev/null | cut -c1-400
  for f in "$logs"/ncu_v*.txt; do
    [[ -e $f ]] || continue
    echo "== $(basename "$f")"
    grep -E 'Duration|Compute \(SM\) Throughput|Issue Slots Busy|Warp Cycles Per Issued|Registers Per|Eligible Warps|No Eligible|Tensor|stalled|exit' "$f" | head -16
  done
  echo "GPU-call wall time of this script: $((SECONDS - t0)) s"
} >"$logs/prefill_summary.txt"
cp "$logs/prefill_summary.txt" "$out/prefill_summary.txt"
tar czf "$out/prefill_logs.tgz" -C "$logs" .
cat "$out/prefill_summary.txt"
exit $status
