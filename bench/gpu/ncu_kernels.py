#!/usr/bin/env python3
"""Median device time per kernel from an `ncu --csv --metrics gpu__time_duration.sum` log.

    ncu --clock-control none --graph-profiling node -k regex:Decode --metrics gpu__time_duration.sum \
        --csv PROGRAM ... > run.csv
    bench/gpu/ncu_kernels.py run.csv

Prints one line per (kernel, grid): how many launches ncu timed and their median in microseconds, in the
order the kernels first ran. ncu's own progress lines (==PROF==) and anything that is not a CSV row of
its table are skipped.
"""
import collections
import csv
import statistics
import sys

_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = [r for r in csv.reader(open(sys.argv[1], newline="")) if len(r) > 10]
    if not rows or "Kernel Name" not in rows[0]:
        sys.exit("%s: no ncu CSV table (was ncu given --csv and a metric?)" % sys.argv[1])
    head = rows[0]
    name, grid = head.index("Kernel Name"), head.index("Grid Size")
    unit, value = head.index("Metric Unit"), head.index("Metric Value")
    times = collections.OrderedDict()
    for r in rows[1:]:
        scale = _UNITS.get(r[unit])
        if scale is None:
            sys.exit("%s: unknown time unit %r" % (sys.argv[1], r[unit]))
        times.setdefault((r[name], r[grid]), []).append(float(r[value].replace(",", "")) * scale)
    for (kernel, g), us in times.items():
        short = kernel.split("(")[0].split("<")[0].split()[-1].split("::")[-1]
        print("%-40s grid %-16s launches %4d  median %9.1f us" % (short, g, len(us), statistics.median(us)))


if __name__ == "__main__":
    main()
