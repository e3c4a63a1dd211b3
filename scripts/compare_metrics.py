#!/usr/bin/env python3
"""Compares the training losses (or step times) of worker metrics files (JSONL).

The worker's train.metrics_file has one object per logged step,
{"step":10,"loss":2.61,...}, and one per evaluation, {"step":50,"val_loss":...}
(docs/worker.md). Only the step records (those with "loss") are compared;
evaluation records are skipped.

  compare_metrics.py curve A B [--after N] [--rel R] [--last-wins]
      Prints a table of step, loss A, loss B and |B - A| / |A| for the steps
      in both, and the largest relative difference after step N. Fails (exit
      1) if one after step N is over R, if a step after N is in one file and
      not the other, or if there is no step after N at all.
      Defaults: --after 50, --rel 0.01.

  compare_metrics.py exact A B [--after N] [--last-wins]
      Every step (after step N, when given) must be in both files with the
      same loss, compared as the text the worker wrote (%.9g: identical fp32
      values give identical text). Fails (exit 1) on the first difference or
      the first step missing from one file, printing it.

  compare_metrics.py speed BASE OTHER... [--after N]
      Prints each file's median step time (the records' "ms", steps after
      N; default 5, past warm-up), and each OTHER's ratio to BASE's: below
      1 is faster. Runs of one config done more than once may be passed as
      BASE,BASE2 (comma-joined): their steps pool into one median. Exit 2
      when a file has no timed step after N.

--last-wins: a step logged more than once in a file counts with its last
record, and a line that does not parse is skipped with a warning. Without
it, either is an error (exit 2): a stale file would otherwise pass. A
resumed worker cuts its file back to its checkpoint's step (docs/worker.md),
so only files of workers before that cut (2026-11-27), or files joined by
hand, need it.

Exit status: 0 the files agree, 1 they differ, 2 a usage or input error.
Python 3 standard library only.
"""

import argparse
import json
import math
import sys


class InputError(Exception):
    pass


def numbered_lines(path):
    """(line number, line) for each non-blank line of PATH."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}")
    return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


def read_losses(path, last_wins):
    """Returns ({step: loss text}, notes) for the step records of PATH."""
    losses = {}
    notes = []
    previous_step = None
    for number, line in numbered_lines(path):
        try:
            # Floats stay as the text the worker wrote.
            record = json.loads(line, parse_float=str, parse_int=str)
            if not isinstance(record, dict):
                raise ValueError("not an object")
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as e:
            message = f"{path}:{number}: not a metrics record ({e}): {line[:120]!r}"
            if not last_wins:
                raise InputError(message)
            notes.append(f"skipped {message}")
            continue
        if "loss" not in record:
            continue  # an evaluation record
        loss = record["loss"]
        if previous_step is not None and step <= previous_step:
            notes.append(
                f"{path}:{number}: step {step} follows step {previous_step} "
                f"(a restart; resumed after step {step - 1} or earlier)")
        previous_step = step
        if step in losses and not last_wins:
            raise InputError(
                f"{path}:{number}: step {step} is logged twice (a resumed run? "
                f"use --last-wins)")
        losses[step] = str(loss)
    if not losses:
        raise InputError(f"{path}: no step records (lines with \"loss\")")
    return losses, notes


def to_float(text, path, step):
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{path}: step {step}: loss {text!r} is not a number")
    return value


def missing_steps(a, b, after, path_a, path_b):
    """Lines naming the steps after AFTER that only one file has."""
    out = []
    for steps, here, there in ((a.keys() - b.keys(), path_a, path_b),
                               (b.keys() - a.keys(), path_b, path_a)):
        steps = sorted(s for s in steps if s > after)
        if steps:
            shown = ", ".join(str(s) for s in steps[:10])
            more = f" and {len(steps) - 10} more" if len(steps) > 10 else ""
            out.append(f"{len(steps)} step(s) in {here} but not in {there}: "
                       f"{shown}{more}")
    return out


def cmd_curve(args):
    a, notes_a = read_losses(args.a, args.last_wins)
    b, notes_b = read_losses(args.b, args.last_wins)
    for note in notes_a + notes_b:
        print(f"note: {note}")
    common = sorted(a.keys() & b.keys())
    print(f"{'step':>7} {'loss A':>12} {'loss B':>12} {'rel diff':>10}")
    worst = None  # (rel, step), after --after
    over = []
    after_count = 0
    for step in common:
        la = to_float(a[step], args.a, step)
        lb = to_float(b[step], args.b, step)
        if la == lb:
            rel = 0.0
        elif la == 0.0 or not (math.isfinite(la) and math.isfinite(lb)):
            rel = math.inf
        else:
            rel = abs(lb - la) / abs(la)
        mark = ""
        if step > args.after:
            after_count += 1
            if worst is None or rel > worst[0]:
                worst = (rel, step)
            if rel > args.rel:
                over.append(step)
                mark = "  over"
        print(f"{step:>7} {la:>12.6f} {lb:>12.6f} {rel:>10.3e}{mark}")
    status = 0
    for line in missing_steps(a, b, args.after, args.a, args.b):
        print(f"FAIL: {line}")
        status = 1
    if worst is None:
        print(f"FAIL: no step after step {args.after} is in both files")
        return 1
    print(f"max rel diff after step {args.after}: {worst[0]:.3e} at step {worst[1]} "
          f"({after_count} steps compared, limit {args.rel:g})")
    if over:
        shown = ", ".join(str(s) for s in over[:10])
        print(f"FAIL: {len(over)} step(s) after step {args.after} differ by more than "
              f"{args.rel:g}: {shown}{' ...' if len(over) > 10 else ''}")
        status = 1
    if status == 0:
        print("curve: pass")
    return status


def cmd_exact(args):
    a, notes_a = read_losses(args.a, args.last_wins)
    b, notes_b = read_losses(args.b, args.last_wins)
    for note in notes_a + notes_b:
        print(f"note: {note}")
    after = args.after if args.after is not None else -1
    problems = missing_steps(a, b, after, args.a, args.b)
    steps = sorted(s for s in a.keys() & b.keys() if s > after)
    if problems:
        for line in problems:
            print(f"FAIL: {line}")
        return 1
    if not steps:
        where = f" after step {args.after}" if args.after is not None else ""
        print(f"FAIL: no step{where} is in both files")
        return 1
    for step in steps:
        if a[step] != b[step]:
            print(f"FAIL: first difference at step {step}: loss {a[step]} in {args.a}, "
                  f"{b[step]} in {args.b}")
            diffs = [s for s in steps if a[s] != b[s]]
            print(f"      {len(diffs)} of {len(steps)} steps differ")
            return 1
    where = f" after step {args.after}" if args.after is not None else ""
    print(f"exact: pass: {len(steps)} steps{where} (steps {steps[0]}..{steps[-1]}), "
          f"every loss identical (last: {a[steps[-1]]})")
    return 0


def read_step_ms(path, after):
    """The "ms" of PATH's step records after step AFTER."""
    ms = []
    for number, line in numbered_lines(path):
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{path}:{number}: not a metrics record ({e}): {line[:120]!r}")
        if "loss" in record and step > after:
            if not isinstance(record.get("ms"), (int, float)):
                raise InputError(f"{path}:{number}: step {step} has no \"ms\"")
            ms.append(float(record["ms"]))
    if not ms:
        raise InputError(f"{path}: no step record after step {after}")
    return ms


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def cmd_speed(args):
    rows = []
    for group in [args.base] + args.others:
        ms = []
        for path in group.split(","):
            ms += read_step_ms(path, args.after)
        rows.append((group, median(ms), len(ms)))
    base = rows[0][1]
    width = max(len(name) for name, _, _ in rows)
    print(f"{'run':<{width}}  {'ms/step':>9}  {'steps':>5}  {'/ base':>7}")
    for name, ms, count in rows:
        print(f"{name:<{width}}  {ms:9.2f}  {count:5d}  {ms / base:7.3f}")
    return 0


def main(argv):
    parser = argparse.ArgumentParser(
        description="Compare the losses of two worker metrics files (JSONL).")
    sub = parser.add_subparsers(dest="command", required=True)
    curve = sub.add_parser("curve", help="losses within a relative tolerance")
    curve.add_argument("a")
    curve.add_argument("b")
    curve.add_argument("--after", type=int, default=50,
                       help="check only steps after this one (default 50)")
    curve.add_argument("--rel", type=float, default=0.01,
                       help="largest allowed |B - A| / |A| (default 0.01)")
    curve.add_argument("--last-wins", action="store_true",
                       help="a step logged twice counts with its last record")
    exact = sub.add_parser("exact", help="bit-identical losses")
    exact.add_argument("a")
    exact.add_argument("b")
    exact.add_argument("--after", type=int, default=None,
                       help="compare only steps after this one (default: all)")
    exact.add_argument("--last-wins", action="store_true",
                       help="a step logged twice counts with its last record")
    speed = sub.add_parser("speed", help="median step time, against the first file")
    speed.add_argument("base")
    speed.add_argument("others", nargs="+")
    speed.add_argument("--after", type=int, default=5,
                       help="time only steps after this one (default 5)")
    args = parser.parse_args(argv)
    if args.command == "curve" and not (args.rel >= 0 and math.isfinite(args.rel)):
        parser.error("--rel must be a finite number >= 0")
    try:
        command = {"curve": cmd_curve, "exact": cmd_exact, "speed": cmd_speed}[args.command]
        return command(args)
    except InputError as e:
        print(f"compare_metrics: ERROR: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
