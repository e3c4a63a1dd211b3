#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (ncu --csv --metrics gpu__time_duration.sum)
by kernel: launches, total milliseconds, mean microseconds, share of the
whole. scripts/gpu_run.sh's `profile` step writes the CSV from one
bench_gpu step; the kernels that set up the model (weights, buffers) are
in it too, each once, and listed as they come.

Usage: profile_summary.py PROFILE.csv [--top N]
"""
import argparse
import collections
import csv
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_path")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()

    # ncu prints its own lines (==PROF== ...) before the CSV's header.
    with open(args.csv_path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    if not lines:
        sys.exit(f"profile_summary: no CSV rows in {args.csv_path}")
    rows = list(csv.DictReader(lines))
    needed = {"ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"}
    if not needed <= set(rows[0]):
        sys.exit(f"profile_summary: {args.csv_path} lacks columns {sorted(needed - set(rows[0]))}")
    scale = {"ns": 1e-6, "nsecond": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}
    total = collections.Counter()
    count = collections.Counter()
    for row in rows:
        if row["Metric Name"] != "gpu__time_duration.sum":
            continue
        unit = row["Metric Unit"]
        if unit not in scale:
            sys.exit(f"profile_summary: unknown time unit '{unit}'")
        ms = float(row["Metric Value"].replace(",", "")) * scale[unit]
        total[row["Kernel Name"]] += ms
        count[row["Kernel Name"]] += 1
    if not total:
        sys.exit("profile_summary: no gpu__time_duration.sum rows")
    whole = sum(total.values())
    print(f"{sum(count.values())} launches of {len(total)} kernels, {whole:.3f} ms of kernel time")
    print(f"{'ms':>8} {'%':>5} {'launches':>8} {'mean us':>8}  kernel")
    for name, ms in total.most_common(args.top):
        print(f"{ms:8.3f} {100 * ms / whole:5.1f} {count[name]:8d} {1e3 * ms / count[name]:8.1f}  "
              f"{name[:110]}")
    rest = total.most_common()[args.top:]
    if rest:
        ms = sum(v for _, v in rest)
        print(f"{ms:8.3f} {100 * ms / whole:5.1f} {sum(count[n] for n, _ in rest):8d}"
              f" {'':8}  ({len(rest)} more kernels)")


if __name__ == "__main__":
    main()
