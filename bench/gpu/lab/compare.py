#!/usr/bin/env python3
"""Before/after table of a product_compare.sh run: for every prefill, decode and sparse row, the
figures of each round and the ratio after / before (means over the rounds; > 1 is slower).

  bench/gpu/lab/compare.py OUT_DIR   (the directory product_compare.sh wrote)
"""
import glob
import os
import re
import sys


def lab_rows(path):
    """{(kind, key...): (time, diff)} from one lab_bench (or dca_bench) output."""
    rows = {}
    section = None
    for line in open(path):
        if line.startswith("## Prefill"):
            section = "prefill"
        elif line.startswith("## Decode variants summary"):
            section = None
        elif line.startswith("## Decode"):
            section = "decode"
        elif section and line[:1].isdigit():
            f = line.split()
            if section == "prefill":
                # L chunk_len chunks name... median_ms TFLOP/s max_diff mean_diff
                name = " ".join(f[3:-4])
                rows[("prefill", int(f[0]), int(f[2]), name)] = (float(f[-4]), f[-2])
            else:
                # batch ctx name splits sets median_us GB/s %copy max_diff
                name = " ".join(f[2:-6])
                rows[("decode", int(f[0]), int(f[1]), name)] = (float(f[-4]), f[-1])
    return rows


def sparse_ms(path):
    for line in open(path):
        m = re.match(r"\| (\d+) \| (\d+) \| ([\d.]+) \|", line)
        if m:
            return float(m.group(3))
    return None


def mean(xs):
    return sum(xs) / len(xs)


def main(out):
    before = [lab_rows(p) for p in sorted(glob.glob(os.path.join(out, "before_*.txt")))]
    after = [lab_rows(p) for p in sorted(glob.glob(os.path.join(out, "after_*.txt")))]
    if not before or not after:
        sys.exit(f"{out}: no before_*.txt / after_*.txt")
    keys = [k for k in after[0] if all(k in r for r in before + after)]
    worst = {}
    for kind in ("decode", "prefill"):
        for k in sorted(k for k in keys if k[0] == kind):
            b = [r[k][0] for r in before]
            a = [r[k][0] for r in after]
            ratio = mean(a) / mean(b)
            worst[kind] = max(worst.get(kind, 0.0), abs(ratio - 1))
            label = " ".join(str(x) for x in k)
            diff = f"  diff {after[0][k][1]} (before {before[0][k][1]})"
            print(f"{label:40} before {' '.join(f'{x:9.3f}' for x in b)} | "
                  f"after {' '.join(f'{x:9.3f}' for x in a)}  ratio {ratio:.3f}{diff}")
        print(f"worst {kind} |ratio-1| {worst.get(kind, 0):.3f}")
    sb = [sparse_ms(p) for p in sorted(glob.glob(os.path.join(out, "sparse_before_*.txt")))]
    sa = [sparse_ms(p) for p in sorted(glob.glob(os.path.join(out, "sparse_after_*.txt")))]
    sb, sa = [x for x in sb if x], [x for x in sa if x]
    if sb and sa:
        print(f"sparse 1M ms: before {sb} | after {sa}  ratio {mean(sa) / mean(sb):.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
