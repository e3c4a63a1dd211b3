#!/usr/bin/env python3
"""Compares a bundle's benches with its baseline's (scripts/gpu_run.sh ab).

Reads logs named TOOL.SIDE.RUN.log (SIDE: baseline or new; RUN: 1, 2, ...),
which gpu_run.sh's `ab` step writes while it alternates the two builds, and
prints per tool one table: each timed row's median over the runs of each
side, each run's figure, and new / baseline (below 1: the new build is
faster). The rows it reads:

  bench_flash  "<tiling or cudnn row>   <ms>   <TFLOP/s>"
  bench_gpu    "<system> B=<b> T=<t>   <ms> ms/step ..."

Exit status: 0 when every tool has at least one row on both sides, 1 when
one has none (a failed or empty run), 2 on bad arguments.
"""
import argparse
import collections
import os
import re
import statistics
import sys

FLASH_ROW = re.compile(r"^(?P<name>\S.*?)\s+(?P<ms>\d+\.\d{4})\s+(?P<rate>\d+\.\d)\s*$")
GPU_ROW = re.compile(
    r"^(?P<name>muster\S*(?: \S+)*?)\s+B=(?P<b>\d+)\s+T=(?P<t>\d+)\s+(?P<ms>\d+\.\d+) ms/step")
LOG_NAME = re.compile(r"^(?P<tool>[a-z_]+)\.(?P<side>baseline|new)\.(?P<run>\d+)\.log$")


def rows_of(tool, text):
    """The (row name, ms) pairs of one run's output, in order."""
    rows = []
    for line in text.splitlines():
        if tool == "bench_gpu":
            m = GPU_ROW.match(line)
            if m:
                rows.append((f"{m['name']} B={m['b']} T={m['t']}", float(m["ms"])))
        else:
            m = FLASH_ROW.match(line)
            if m:
                rows.append((m["name"], float(m["ms"])))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="?", help="the baseline's commit, for the title")
    parser.add_argument("--new", default="?", help="the new build's source, for the title")
    parser.add_argument("logs", nargs="+", help="TOOL.SIDE.RUN.log files")
    args = parser.parse_args()

    # tool -> side -> row -> [(run, ms)], rows in first-seen order per tool.
    times = collections.defaultdict(lambda: collections.defaultdict(dict))
    order = collections.defaultdict(list)
    for path in args.logs:
        m = LOG_NAME.match(os.path.basename(path))
        if not m:
            print(f"ab_compare: {path}: not named TOOL.SIDE.RUN.log", file=sys.stderr)
            return 2
        tool, side, run = m["tool"], m["side"], int(m["run"])
        with open(path, encoding="utf-8", errors="replace") as f:
            for name, ms in rows_of(tool, f.read()):
                times[tool][side].setdefault(name, []).append((run, ms))
                if name not in order[tool]:
                    order[tool].append(name)

    print(f"ab: baseline {args.baseline} against new {args.new}; medians of alternating runs;"
          " new/base below 1: the new build is faster")
    status = 0
    for tool in sorted(times):
        base, new = times[tool]["baseline"], times[tool]["new"]
        if not base or not new:
            print(f"{tool}: no timed rows from the {'baseline' if not base else 'new'} build")
            status = 1
            continue
        print(f"\n{tool} (ms)")
        print(f"{'row':<50} {'baseline':>9} {'new':>9} {'new/base':>9}  runs (baseline | new)")
        for name in order[tool]:
            b = [ms for _, ms in sorted(base.get(name, []))]
            n = [ms for _, ms in sorted(new.get(name, []))]
            b_med = statistics.median(b) if b else float("nan")
            n_med = statistics.median(n) if n else float("nan")
            ratio = n_med / b_med if b and n and b_med > 0 else float("nan")
            runs = " ".join(f"{x:.4g}" for x in b) + " | " + " ".join(f"{x:.4g}" for x in n)
            print(f"{name:<50} {b_med:>9.4f} {n_med:>9.4f} {ratio:>9.3f}  {runs}")
    return status


if __name__ == "__main__":
    sys.exit(main())
