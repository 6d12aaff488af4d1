"""Compare runs side by side from their metrics.jsonl: per metric, the mean over all steps and the mean of the
last 20% of steps (the same words as the run summary, where "final" is a metric's last logged value), plus the
summary's held-out accuracy; with --plot, one panel per metric and one curve per run (metrics logged on some
steps only, like the high-precision shadow, as markers).

    python tools/compare_runs.py runs/tiny_grpo runs/tiny_fp8_grpo_nocalib runs/tiny_fp8_grpo [--plot compare.png]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_rl.tracking import read_metrics
from megatron_rl.tracking.report import final_value, mean_of, tail_rows

DEFAULT_KEYS = ["clipfrac_lower_neg", "hp/clipfrac_lower_neg", "clipfrac_upper_pos", "calib/lower", "calib/upper",
                "entropy", "reward/mean", "mismatch_abs_dlogp", "token_mult_prob_error", "fp8/log_ratio_abs_err"]

COLUMNS = (("mean", lambda rows, key: mean_of(rows, key)),
           ("mean of last 20%", lambda rows, key: mean_of(tail_rows(rows), key)),
           ("final", final_value))
"""(header, statistic) of each run's columns."""


def summary_accuracy(run: Path) -> str:
    """'before -> after' held-out accuracy from summary.txt, if present."""
    path = run / "summary.txt"
    if not path.exists():
        return "n/a"
    lines = dict(line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)
    return f"{lines.get('held-out greedy accuracy (before RL)', '?')} -> {lines.get('held-out greedy accuracy (after RL)', '?')}"


def table(runs: dict[str, list[dict]], run_dirs: list[Path], keys: list[str]) -> str:
    """The comparison as aligned text: a row per metric, three columns per run (see COLUMNS)."""
    width = max(len(k) for k in [*keys, "held-out acc (before -> after)"]) + 2
    cell = max(len(h) for h, _ in COLUMNS) + 2
    group = cell * len(COLUMNS)
    lines = ["metric".ljust(width) + "".join(name[: group - 2].center(group) for name in runs),
             "".ljust(width) + "".join(h.rjust(cell) for _ in runs for h, _ in COLUMNS),
             "held-out acc (before -> after)".ljust(width) + "".join(summary_accuracy(d).rjust(group) for d in run_dirs)]
    for key in keys:
        cells = []
        for rows in runs.values():
            for _, stat in COLUMNS:
                v = stat(rows, key)
                cells.append((f"{v:.4g}" if math.isfinite(v) else "n/a").rjust(cell))
        lines.append(key.ljust(width) + "".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    """Print the comparison table (and save a plot when asked)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with a metrics.jsonl)")
    ap.add_argument("--keys", nargs="*", default=DEFAULT_KEYS, help="metrics to compare (metrics.jsonl keys)")
    ap.add_argument("--plot", type=Path, default=None, help="also write a PNG with one panel per metric")
    args = ap.parse_args(argv)
    missing = [str(run / "metrics.jsonl") for run in args.runs if not (run / "metrics.jsonl").is_file()]
    if missing:
        print(f"error: no metrics file: {', '.join(missing)}", file=sys.stderr)
        return 2
    names = [run.name for run in args.runs]
    if len(set(names)) < len(names):  # same leaf name in different folders: tell them apart by the full path
        names = [str(run) for run in args.runs]
    runs = {name: read_metrics(run / "metrics.jsonl") for name, run in zip(names, args.runs)}
    print(table(runs, list(args.runs), list(args.keys)))
    if args.plot:
        from megatron_rl.tracking.plots import plot_runs

        print(f"plot: {plot_runs(runs, list(args.keys), args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
