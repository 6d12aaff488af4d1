"""Compare runs side by side from their metrics.jsonl: mean of chosen metrics over all steps and over the
last 20% of steps, plus the summary's held-out accuracy; optionally plot curves (needs matplotlib).

    python tools/compare_runs.py runs/tiny_grpo runs/tiny_fp8_grpo_nocalib runs/tiny_fp8_grpo [--plot out.png]
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from megatron_rl.tracking import read_metrics

DEFAULT_KEYS = ["clipfrac_lower_neg", "hp/clipfrac_lower_neg", "clipfrac_upper_pos", "calib/lower", "calib/upper",
                "entropy", "reward/mean", "mismatch_abs_dlogp", "token_mult_prob_error", "fp8/log_ratio_abs_err"]


def mean(values: list) -> float:
    """Mean of the finite numbers in `values` (nan if none)."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def summary_accuracy(run: Path) -> str:
    """'before -> after' held-out accuracy from summary.txt, if present."""
    path = run / "summary.txt"
    if not path.exists():
        return "n/a"
    lines = dict(line.split(": ", 1) for line in path.read_text().splitlines() if ": " in line)
    return f"{lines.get('held-out greedy accuracy (before RL)', '?')} -> {lines.get('held-out greedy accuracy (after RL)', '?')}"


def main() -> None:
    """Print the comparison table (and save a plot when asked)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--keys", nargs="*", default=DEFAULT_KEYS)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    data = {run: read_metrics(run / "metrics.jsonl") for run in args.runs}
    width = max(len(k) for k in args.keys) + 2
    print("metric".ljust(width) + "".join(run.name[:28].rjust(30) for run in args.runs))
    print("held-out acc".ljust(width) + "".join(summary_accuracy(run).rjust(30) for run in args.runs))
    for key in args.keys:
        cells = []
        for run in args.runs:
            rows = data[run]
            tail = rows[-max(1, len(rows) // 5):]
            cells.append(f"{mean([r.get(key) for r in rows]):.4g} (last {mean([r.get(key) for r in tail]):.4g})".rjust(30))
        print(key.ljust(width) + "".join(cells))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(args.keys), figsize=(4 * len(args.keys), 3))
        for ax, key in zip(axes, args.keys):
            for run in args.runs:
                ax.plot([r["step"] for r in data[run]], [r.get(key) if isinstance(r.get(key), (int, float)) else math.nan for r in data[run]], label=run.name)
            ax.set_title(key)
        axes[0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
