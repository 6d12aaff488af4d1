"""Pictures of runs from their metrics.jsonl rows: the main job's RUN_DIR/plots/*.png and compare_runs' --plot.

    from megatron_rl.tracking.plots import plot_run, plot_runs
    plot_run(read_metrics("runs/tiny_fp8_grpo/metrics.jsonl"), "runs/tiny_fp8_grpo/plots")   # -> [paths]
    plot_runs({"fp8": rows_a, "bf16": rows_b}, ["entropy", "calib/lower"], "compare.png")

Figures are drawn with matplotlib's Agg canvas directly (no pyplot, no display, no global backend state).
A metric logged on every step is drawn as a line; one logged only on some steps (the high-precision
shadow metrics of calibration steps, held-out accuracy every eval_every steps) is drawn as markers, so
it never shows as an empty panel.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Optional, Sequence

# One PNG per entry: file stem -> (title, y label, [(metric key, legend label), ...]).
RUN_FIGURES: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "reward": ("Reward and accuracy", "value", [
        ("reward/mean", "train reward (mean)"),
        ("accuracy/train", "train accuracy"),
        ("accuracy/eval", "held-out greedy accuracy"),
    ]),
    "entropy": ("Policy entropy", "nats / token", [("entropy", "entropy")]),
    # like with like: the shadow's clip fractions count off-policy updates only (the on-policy first mini-batch has
    # ratio 1 and clips nothing), so the run is drawn over the same updates (offpolicy/), not over every update
    "clipfrac": ("Clip fractions by advantage sign (off-policy updates)", "fraction of tokens", [
        ("offpolicy/clipfrac_lower_neg", "A<0, r < L"),
        ("offpolicy/clipfrac_upper_pos", "A>0, r > H"),
        ("hp/clipfrac_lower_neg", "A<0, r < L (high-precision shadow)"),
        ("hp/clipfrac_upper_pos", "A>0, r > H (high-precision shadow)"),
    ]),
    "bounds": ("Clip bounds L / H", "ratio bound", [
        ("calib/lower", "L (lower bound)"),
        ("calib/upper", "H (upper bound)"),
    ]),
}


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float], bool]:
    """(steps, values, sparse) of `key`: only rows where it is a finite number; sparse when some rows lack it."""
    steps, values = [], []
    for i, row in enumerate(rows):
        value = row.get(key)
        if _finite(value):
            steps.append(int(row.get("step", i)))
            values.append(float(value))
    return steps, values, len(values) < len(rows)


def _draw(ax, rows: Sequence[dict], key: str, label: str) -> bool:
    """Draw one metric on `ax` (line, or markers when sparse); False when it has no finite value."""
    steps, values, sparse = metric_series(rows, key)
    if not values:
        return False
    if sparse or len(values) == 1:
        ax.plot(steps, values, marker="o", markersize=3.5, linestyle=":", linewidth=0.8, label=f"{label} (logged on {len(values)} steps)")
    else:
        ax.plot(steps, values, linewidth=1.2, label=label)
    return True


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _new_figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def plot_run(rows: Sequence[dict], out_dir: str | Path) -> list[Path]:
    """Write one PNG per RUN_FIGURES entry that has data into `out_dir`; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, (title, ylabel, series) in RUN_FIGURES.items():
        fig = _new_figure(6.4, 3.6)
        ax = fig.add_subplot()
        drawn = [_draw(ax, rows, key, label) for key, label in series]
        path = out_dir / f"{stem}.png"
        if not any(drawn):
            path.unlink(missing_ok=True)  # a stale picture from an earlier run in this directory would mislead
            continue
        ax.set_title(title)
        ax.set_xlabel("RL step")
        _integer_steps(ax)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path)
        written.append(path)
    return written


def plot_runs(runs: Mapping[str, Sequence[dict]], keys: Sequence[str], out_path: str | Path,
              columns: Optional[int] = None) -> Path:
    """One panel per metric key, one curve per run (markers where a run logs the metric on some steps only)."""
    columns = columns or min(4, len(keys))
    n_rows = math.ceil(len(keys) / columns)
    fig = _new_figure(4.2 * columns, 3.2 * n_rows)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(n_rows, columns, i + 1)
        drawn = [_draw(ax, rows, key, name) for name, rows in runs.items()]
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("RL step", fontsize=8)
        _integer_steps(ax)
        ax.grid(alpha=0.3)
        if any(drawn):
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    return out_path
