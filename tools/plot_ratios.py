"""Histograms of the dumped calibration ratios: FP8 and high-precision, by advantage sign, with L and H marked.

    python tools/plot_ratios.py RUN_DIR [--step N] [--out PATH] [--bins 80]

Reads RUN_DIR/calibration/step_{N:06d}.rank*.npz (written by `tracking.dump_ratios: true` on each
calibration step, one file per DP x CP rank) and the step's row of RUN_DIR/metrics.jsonl, and writes
one PNG (default RUN_DIR/calibration/step_{N:06d}.png; --step defaults to the newest dumped step):
two panels (A < 0 and A > 0), each with the FP8 and the high-precision ratio histograms over log r, the
uncalibrated bounds 1 - eps_low / 1 + eps_high (dotted, eps from RUN_DIR/config.yaml), the step's
unsmoothed solve calib/solve_lower / calib/solve_upper (solid) and the held bounds after the step
calib/lower / calib/upper (dashed). Prints the PNG path.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Optional

import numpy as np

_STEP = re.compile(r"^step_(\d{6,})\.rank(\d+)\.npz$")


def dumped_steps(run_dir: Path) -> list[int]:
    """Steps that have ratio dumps, ascending."""
    d = run_dir / "calibration"
    steps = {int(m.group(1)) for f in d.glob("*.npz") if (m := _STEP.match(f.name))} if d.is_dir() else set()
    return sorted(steps)


def load_step(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    """The step's dumps of every rank, concatenated."""
    files = sorted((run_dir / "calibration").glob(f"step_{step:06d}.rank*.npz"))
    if not files:
        raise FileNotFoundError(f"{run_dir / 'calibration'}: no dumps of step {step} (run with tracking.dump_ratios=true)")
    parts = [np.load(f) for f in files]
    return {k: np.concatenate([p[k] for p in parts]) for k in ("ratio", "ratio_hp", "adv", "minibatch")}


def metrics_row(run_dir: Path, step: int) -> dict:
    """The step's metrics.jsonl row ({} when absent)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    row: dict = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("step") == step:
                row = r  # a resumed run may have rewritten the step: the last row wins
    return row


def eps_of(run_dir: Path) -> tuple[float, float]:
    """(eps_low, eps_high) from RUN_DIR/config.yaml (0.2, 0.2 when absent)."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return 0.2, 0.2
    from megatron_rl.config.yaml_io import load_yaml_file

    p = (load_yaml_file(path) or {}).get("algo", {}).get("policy_loss", {})
    return float(p.get("eps_low", 0.2)), float(p.get("eps_high", 0.2))


def _mark(ax, x: Optional[float], style: str, color: str, label: str) -> None:
    if x is not None and isinstance(x, (int, float)) and math.isfinite(x) and x > 0:
        ax.axvline(math.log(x), linestyle=style, color=color, linewidth=1.2, label=f"{label} = {x:.4f}")


def plot(run_dir: Path, step: int, out: Path, bins: int = 80) -> Path:
    """Draw the step's histograms into `out` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, row = load_step(run_dir, step), metrics_row(run_dir, step)
    eps_low, eps_high = eps_of(run_dir)
    lr8, lrhp = np.log(d["ratio"]), np.log(d["ratio_hp"])
    finite = np.concatenate([lr8, lrhp[np.isfinite(lrhp)]])
    lim = max(float(np.quantile(np.abs(finite), 0.999)) if finite.size else 0.5, abs(math.log(1 - eps_low)) * 1.5, 0.05)
    edges = np.linspace(-lim, lim, bins + 1)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharex=True)
    for ax, (name, sel) in zip(axes, (("A < 0 (N)", d["adv"] < 0), ("A > 0 (P)", d["adv"] > 0))):
        ax.hist(np.clip(lr8[sel], -lim, lim), bins=edges, alpha=0.55, label=f"FP8 ({int(sel.sum())} tokens)")
        hp = lrhp[sel & np.isfinite(lrhp)]
        if hp.size:
            ax.hist(np.clip(hp, -lim, lim), bins=edges, alpha=0.55, label="high precision")
        _mark(ax, 1 - eps_low, ":", "gray", "1 - eps_low")
        _mark(ax, 1 + eps_high, ":", "gray", "1 + eps_high")
        _mark(ax, row.get("calib/solve_lower"), "-", "crimson", "L solved")
        _mark(ax, row.get("calib/solve_upper"), "-", "navy", "H solved")
        _mark(ax, row.get("calib/lower"), "--", "crimson", "L held")
        _mark(ax, row.get("calib/upper"), "--", "navy", "H held")
        ax.set_yscale("log")
        ax.set_xlabel("log ratio  log(pi / pi_old)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("tokens")
    fmt = lambda x: f"{x:.4f}" if isinstance(x, (int, float)) else "n/a"  # noqa: E731
    fig.suptitle(f"{run_dir.name}: calibration step {step}  (alpha target {fmt(row.get('calib/alpha_target'))}, "
                 f"achieved {fmt(row.get('calib/alpha_achieved'))}; rho target {fmt(row.get('calib/rho_target'))}, "
                 f"achieved {fmt(row.get('calib/rho_achieved'))})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="run directory holding calibration/step_*.rank*.npz and metrics.jsonl")
    ap.add_argument("--step", type=int, default=None, help="calibration step to draw (default: the newest dumped one)")
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/calibration/step_N.png)")
    ap.add_argument("--bins", type=int, default=80, help="histogram bins over log r")
    args = ap.parse_args(argv)
    steps = dumped_steps(args.run_dir)
    if not steps:
        print(f"error: {args.run_dir / 'calibration'} holds no ratio dumps (run with tracking.dump_ratios=true)", file=sys.stderr)
        return 2
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        print(f"error: no dumps of step {step}; dumped steps: {steps}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "calibration" / f"step_{step:06d}.png"
    print(plot(args.run_dir, step, out, args.bins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
